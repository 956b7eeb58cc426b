"""Command line: `moeprefetch generate [PATH] --prompt ...`, `moeprefetch serve [PATH]` (the OpenAI HTTP API),
`moeprefetch report RESULTS`, `moeprefetch replay TRACE --slots N`, `moeprefetch info PATH`,
`moeprefetch train-predictor PATH --text FILE --out predictor.safetensors` (predictor_training.py).

Errors the engine raises on bad input are printed as one line (no traceback) with a non-zero exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn, Sequence

from .checkpoint import REFERENCE_MODEL
from .errors import MoEPrefetchError

DEFAULT_PROMPT = "The kernel's memory manager"
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


def _engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine options `generate` and `serve` share."""
    from .expert_records import EXPERT_DTYPES
    from .options import DRAFT_EXPERTS, FILL_LINK, LATE_PREFETCH, VERIFY_ROWS, EngineConfig
    from .predictors import PREDICTOR_NAMES

    defaults = EngineConfig()
    parser.add_argument("--device", default="cpu", help=EngineConfig.help("device"))
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    parser.add_argument("--cache-slots", type=int, default=None, help=EngineConfig.help("expert_cache_slots"))
    parser.add_argument("--cache-fraction", type=float, default=None,
                        help="expert slots as a share of all routed experts (default 0.25 for the reference model)")
    parser.add_argument("--vram-budget", default=None, help=EngineConfig.help("vram_budget"))
    parser.add_argument("--all-resident", action="store_true", help="keep every expert in device memory")
    parser.add_argument("--policy", default=defaults.policy, help=EngineConfig.help("policy"))
    parser.add_argument("--lrfu-halflife", type=float, default=defaults.lrfu_halflife,
                        help=EngineConfig.help("lrfu_halflife"))
    parser.add_argument("--predictor", default=None,
                        help=f"{', '.join(PREDICTOR_NAMES)}, or a combination such as mtp+next_layer_gate")
    parser.add_argument("--predictor-path", default=None, help=EngineConfig.help("predictor_path"))
    parser.add_argument("--lookahead", type=int, default=None, help=EngineConfig.help("lookahead"))
    parser.add_argument("--min-confidence", type=float, default=None, help=EngineConfig.help("min_confidence"))
    parser.add_argument("--fill-confidence", type=float, default=defaults.fill_confidence,
                        help=EngineConfig.help("fill_confidence"))
    parser.add_argument("--reuse-weight", type=float, default=defaults.reuse_weight,
                        help=EngineConfig.help("reuse_weight"))
    parser.add_argument("--bypass", action=argparse.BooleanOptionalAction, default=defaults.bypass,
                        help=EngineConfig.help("bypass"))
    parser.add_argument("--fill-link", choices=FILL_LINK, default=defaults.fill_link,
                        help=EngineConfig.help("fill_link"))
    parser.add_argument("--routing-trace", default=None, help=EngineConfig.help("routing_trace"))
    parser.add_argument("--prefetch-budget", type=float, default=defaults.prefetch_budget,
                        help=EngineConfig.help("prefetch_budget"))
    parser.add_argument("--draft-experts", choices=DRAFT_EXPERTS, default=defaults.draft_experts,
                        help=EngineConfig.help("draft_experts"))
    parser.add_argument("--verify-confidence", type=float, default=defaults.verify_confidence,
                        help=EngineConfig.help("verify_confidence"))
    parser.add_argument("--draft-tokens", type=int, default=defaults.draft_tokens,
                        help=EngineConfig.help("draft_tokens"))
    parser.add_argument("--verify-rows", choices=VERIFY_ROWS, default=defaults.verify_rows,
                        help=EngineConfig.help("verify_rows"))
    parser.add_argument("--spare-recent", type=int, default=defaults.spare_recent, help=EngineConfig.help("spare_recent"))
    parser.add_argument("--prefetch-lead", type=int, default=defaults.prefetch_lead,
                        help=EngineConfig.help("prefetch_lead"))
    parser.add_argument("--late-prefetch", choices=LATE_PREFETCH, default=defaults.late_prefetch,
                        help=EngineConfig.help("late_prefetch"))
    parser.add_argument("--max-seq-len", type=int, default=None, help=EngineConfig.help("max_seq_len"))
    parser.add_argument("--prefill-chunk", type=int, default=None, help=EngineConfig.help("prefill_chunk"))
    parser.add_argument("--prefill-window", type=int, default=None, help=EngineConfig.help("prefill_window"))
    parser.add_argument("--max-batch-size", type=int, default=None, help=EngineConfig.help("max_batch_size"))
    parser.add_argument("--expert-dtype", choices=EXPERT_DTYPES, default=None, help=EngineConfig.help("expert_dtype"))
    parser.add_argument("--int4-group-size", type=int, default=None, help=EngineConfig.help("int4_group_size"))
    parser.add_argument("--int4-symmetric", action="store_true", default=None,
                        help=EngineConfig.help("int4_symmetric"))
    parser.add_argument("--distributed", action="store_true",
                        help=EngineConfig.help("distributed") + " (torchrun --nproc-per-node N -m moeprefetch ...)")


class OneLineParser(argparse.ArgumentParser):
    """An argument error in one line and exit status 2, as the engine's own errors (argparse would print the whole
    usage block first); sub-command parsers are of the same class."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    common = OneLineParser(add_help=False)  # -v works before or after the sub-command
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="log progress and memory plans")
    parser = OneLineParser(prog="moeprefetch", parents=[common], description="Run DeepSeek-style MoE "
                                     "models with expert offloading and MTP-driven prefetching.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", parents=[common], help="generate text from a checkpoint directory")
    gen.add_argument("path", nargs="?", default=str(REFERENCE_MODEL),
                        help="Hugging Face checkpoint directory (default: the embedded reference model)")
    gen.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    gen.add_argument("--prompt-ids", action="append", help="comma-separated token ids (repeat for a batch)")
    gen.add_argument("--max-new-tokens", type=int, default=48)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--logit-bias", action="append", default=None, metavar="ID=BIAS",
                     help="add BIAS (-100 to 100) to token ID's logit before every choice (repeat for more tokens)")
    gen.add_argument("--presence-penalty", type=float, default=0.0,
                     help="subtract this (-2 to 2) from a token's logit once it has been generated")
    gen.add_argument("--frequency-penalty", type=float, default=0.0,
                     help="subtract this (-2 to 2) per time a token has been generated")
    _engine_arguments(gen)
    gen.add_argument("--speculative", choices=["mtp", "auto"], default=None,
                     help="mtp: verify the MTP draft in each step; auto: on when this engine measured it faster "
                          "(it learns across calls, so one call of the CLI measures plain decode)")
    gen.add_argument("--no-stream", action="store_true", help="print the text at the end instead of streaming it")
    gen.add_argument("--stats-json", default=None, help="write result.stats.to_dict() here")
    gen.add_argument("--events-jsonl", default=None,
                     help="write the call's counters here as JSON lines: one line for the call, then one per MoE layer")

    srv = sub.add_parser("serve", parents=[common], help="serve the OpenAI HTTP API (needs the extra .[serve])")
    srv.add_argument("path", nargs="?", default=str(REFERENCE_MODEL))
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--model-name", default=None, help="the model id clients send (default: the directory name)")
    srv.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond the batch (then 429)")
    srv.add_argument("--batch-invariant", action="store_true",
                     help="every decode step computes --max-batch-size rows, so a request's tokens never depend on "
                          "how many others are served (on CUDA fewer rows may pick other kernels); by default a step "
                          "computes only the rows in use, rounded up to a power of two")
    srv.add_argument("--max-tokens", type=int, default=256, help="max_tokens when a request gives none")
    srv.add_argument("--drain-seconds", type=float, default=30.0,
                        help="on Ctrl-C or SIGTERM, how long requests in flight may finish (a second signal cuts "
                             "them short); the rest get 503")
    srv.add_argument("--api-key", default=os.environ.get("MOEPREFETCH_API_KEY"),
                     help="require 'Authorization: Bearer KEY' on /v1/* (default: $MOEPREFETCH_API_KEY, which, unlike "
                          "the command line, other users cannot see; none: open)")
    srv.add_argument("--allowed-hosts", default=None,
                     help="comma list of Host header names answered, or '*' (default: loopback names when bound to "
                          "a loopback address, else any)")
    srv.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (then 413)")
    srv.add_argument("--prefill-tokens-per-step", type=int, default=512,
                     help="prompt tokens prefilled between two decode steps while requests decode (at least one "
                          "--prefill-chunk): fewer stall the streams less, more admit prompts sooner")
    srv.add_argument("--admit-wait-ms", type=float, default=2.0,
                     help="milliseconds an idle server waits after a request for others sent with it, and again "
                          "after each that arrives (8 waits at most), so that they are prefilled together (0: none)")
    srv.add_argument("--body-timeout", type=float, default=30.0,
                     help="seconds a request's headers, and then its body, may take to arrive (then 408)")
    _engine_arguments(srv)

    rep = sub.add_parser("report", parents=[common],
                         help="markdown report (tables, plots) from a sweep's results.jsonl")
    rep.add_argument("results", help="results.jsonl of a sweep, or a stats JSON written by generate --stats-json")
    rep.add_argument("--out", default=None, help="output directory (default: next to the results)")

    _replay_arguments(sub.add_parser("replay", parents=[common], help="replay a routing trace through the "
                                     "residency's own victim code (CPU): hits, misses and bytes per token, Belady's "
                                     "floor, k-tokens-ahead lines"))
    _train_arguments(sub.add_parser("train-predictor", parents=[common], help="train a learned routing predictor "
                                    "from the checkpoint's own routing over text (CPU is enough for small models)"))

    info = sub.add_parser("info", parents=[common], help="describe a checkpoint: architecture, experts, memory")
    info.add_argument("path", nargs="?", default=str(REFERENCE_MODEL))
    return parser


def _replay_arguments(rpl: argparse.ArgumentParser) -> None:
    from .options import EngineConfig

    rpl.add_argument("trace", help="a routing trace (JSON lines of [layer, expert] pairs per token, as in "
                     "../shared/traces, or a checkpoint's own from scripts/record_trace.py)")
    rpl.add_argument("--slots", type=int, required=True, help="expert cache slots (across all layers)")
    rpl.add_argument("--policy", default="lru,lrfu", help="cache policies, comma list (lrfu, lru, lfu)")
    rpl.add_argument("--predictor", default="none,oracle_next",
                     help="what predictions protect, comma list: none, previous, oracle_next, ahead:K, oracle")
    rpl.add_argument("--fills", action="store_true", help="also prefetch what is predicted (fills land at once)")
    rpl.add_argument("--lrfu-halflife", type=float, default=EngineConfig.lrfu_halflife,
                     help="lrfu: a use counts half after N steps")
    rpl.add_argument("--ahead", default="1,4", help="the k-tokens-ahead reference lines, comma list of k")
    rpl.add_argument("--experts", type=int, default=None, help="experts per layer (default: the largest id + 1)")
    rpl.add_argument("--expert-mb", type=float, default=17.3015, help="bytes of one expert, in MB (bytes per token)")
    rpl.add_argument("--tokens", type=int, default=None, help="replay only the first N tokens")
    rpl.add_argument("--json", default=None, help="also write the rows here")


def _train_arguments(trn: argparse.ArgumentParser) -> None:
    trn.add_argument("path", help="checkpoint directory")
    source = trn.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", nargs="+", help="UTF-8 text files to record routing over")
    source.add_argument("--ids", nargs="+", help="token-id files to record routing over, for a checkpoint without a "
                        "tokenizer: .npy arrays, or text of integers separated by spaces, commas or newlines")
    trn.add_argument("--out", required=True, help="the predictor file to write (.safetensors)")
    trn.add_argument("--leads", type=int, default=1, help="tokens ahead to predict (t+1 .. t+leads)")
    trn.add_argument("--horizon", type=int, default=None, help="also learn which experts any of the next H tokens "
                     "need, what victims are ranked by (reuse_weight; default 8; 0: none, the leads' own "
                     "probabilities rank them)")
    trn.add_argument("--steps", type=int, default=1500, help="optimizer steps")
    trn.add_argument("--device", default="cpu")
    trn.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                     help="the dtype the checkpoint runs in while its routing is recorded (default: bfloat16 on "
                          "CUDA, float32 on the CPU, as decode runs there)")
    trn.add_argument("--eval-share", type=float, default=0.1, help="share of the text's windows held out")
    trn.add_argument("--max-tokens", type=int, default=1 << 20, help="tokens of text recorded at most")
    trn.add_argument("--no-resume", action="store_true", help="start afresh even if a resume state exists")
    trn.add_argument("--json", default=None, help="also write the evaluation here")


def _generate(ns: argparse.Namespace) -> int:
    from .build import has_tokenizer
    from .engine import MoEPrefetchEngine
    from .options import EngineConfig

    if ns.stats_json:  # fail now, not after the whole generation
        _check_writable(Path(ns.stats_json), "--stats-json")
    if ns.events_jsonl:
        _check_writable(Path(ns.events_jsonl), "--events-jsonl")
    kwargs = _engine_kwargs(ns)
    prompts: list[Any] = list(ns.prompt or [])
    for ids in ns.prompt_ids or []:
        try:
            prompts.append([int(t) for t in ids.split(",") if t.strip()])
        except ValueError:
            raise MoEPrefetchError(f"--prompt-ids must be comma-separated integers, got {ids!r}") from None
    if not prompts:
        if not has_tokenizer(Path(ns.path)):  # the default prompt is text
            raise MoEPrefetchError(f"{ns.path} has no tokenizer (no tokenizer.json), so there is no default prompt: "
                                   f"give token ids with --prompt-ids")
        prompts = [DEFAULT_PROMPT]
    # a batch as large as the prompts unless one was asked for (0 included: the options reject it in one sentence)
    kwargs["max_batch_size"] = ns.max_batch_size if ns.max_batch_size is not None else max(len(prompts), 1)
    engine = MoEPrefetchEngine.from_pretrained(ns.path, config=EngineConfig.from_mapping(kwargs))
    group = engine.residency.group
    if group is None:
        return _run_generation(ns, engine, prompts, write_stats=True)
    import torch.distributed as dist

    try:
        if group.rank != 0:  # every rank computes the same tokens; rank 0 alone prints
            with contextlib.redirect_stdout(io.StringIO()):
                return _run_generation(ns, engine, prompts, write_stats=False)
        return _run_generation(ns, engine, prompts, write_stats=True)
    finally:
        dist.destroy_process_group()  # this process is done with the group the engine joined


def _bias_mapping(entries: list[str] | None) -> dict[int, float] | None:
    """The repeated --logit-bias ID=BIAS entries as generate's mapping (a token given twice: its last bias)."""
    mapping = {}
    for text in entries or []:
        token, sep, bias = text.partition("=")
        try:
            if not sep:
                raise ValueError
            mapping[int(token)] = float(bias)
        except ValueError:
            raise MoEPrefetchError(f"--logit-bias takes ID=BIAS (a token id and a number, e.g. 42=-100), got "
                                   f"{text!r}") from None
    return mapping or None


def _run_generation(ns: argparse.Namespace, engine, prompts: list[Any], write_stats: bool) -> int:
    import torch

    from .report import summary_lines

    streaming = not ns.no_stream and len(prompts) == 1 and engine.tokenizer is not None
    echoed = [False]

    def on_token(event) -> None:
        if not streaming:
            return
        if not echoed[0]:  # the prompt is echoed once the request has passed its checks and produced a token
            print(prompts[0] if isinstance(prompts[0], str) else "", end="", flush=True)
            echoed[0] = True
        if event.text:
            print(event.text, end="", flush=True)

    result = engine.generate(prompts, max_new_tokens=ns.max_new_tokens, temperature=ns.temperature, top_k=ns.top_k,
                             top_p=ns.top_p, seed=ns.seed, speculative=ns.speculative, callback=on_token,
                             event_log=ns.events_jsonl, logit_bias=_bias_mapping(ns.logit_bias),
                             presence_penalty=ns.presence_penalty, frequency_penalty=ns.frequency_penalty)
    if streaming:
        print()
    else:
        for i, prompt in enumerate(prompts):
            text = result.texts[i] if result.texts is not None else " ".join(map(str, result.sequences[i]))
            head = prompt if isinstance(prompt, str) else f"<{len(prompt)} token ids>"
            print(f"[{i}] {head}{text}" if result.texts is not None else f"[{i}] {head} -> {text}")
    stats = result.stats.to_dict()
    memory = engine.memory_stats()
    print("\n" + "\n".join(summary_lines(stats, memory, str(torch.device(ns.device)))))
    if result.interrupted:
        print("(interrupted: the tokens above are those produced before Ctrl-C)")
    if ns.stats_json and write_stats:
        Path(ns.stats_json).write_text(json.dumps({"stats": stats, "memory": memory}, indent=1, default=str))
    engine.close()
    return EXIT_INTERRUPTED if result.interrupted else 0


def _engine_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig fields from the shared engine options."""
    from .options import check_one_cache_size

    sizes = [flag for flag, given in (("--cache-slots", ns.cache_slots is not None),
                                      ("--cache-fraction", ns.cache_fraction is not None),
                                      ("--vram-budget", ns.vram_budget is not None), ("--all-resident", ns.all_resident))
             if given]
    check_one_cache_size(sizes)
    dtype = ns.dtype if ns.dtype is not None else ("bfloat16" if ns.device.startswith("cuda") else "float32")
    kwargs: dict[str, Any] = dict(device=ns.device, dtype=dtype, policy=ns.policy, lrfu_halflife=ns.lrfu_halflife,
                                  prefetch_budget=ns.prefetch_budget,
                                  draft_experts=ns.draft_experts, verify_confidence=ns.verify_confidence,
                                  draft_tokens=ns.draft_tokens, verify_rows=ns.verify_rows,
                                  spare_recent=ns.spare_recent,
                                  prefetch_lead=ns.prefetch_lead, late_prefetch=ns.late_prefetch, progress=ns.verbose,
                                  distributed=ns.distributed, fill_confidence=ns.fill_confidence,
                                  fill_link=ns.fill_link, routing_trace=ns.routing_trace,
                                  reuse_weight=ns.reuse_weight, bypass=ns.bypass)
    if ns.lookahead is not None and ns.lookahead > 1 and ns.predictor is None:
        raise MoEPrefetchError(f"--lookahead {ns.lookahead} means nothing to the default predictor 'none': give "
                               f"--predictor too (next_layer_gate, mtp, ...)")
    for name in ("max_seq_len", "prefill_chunk", "prefill_window", "predictor", "lookahead", "min_confidence",
                 "max_batch_size", "expert_dtype", "int4_group_size", "int4_symmetric", "predictor_path"):
        if getattr(ns, name, None) is not None:
            kwargs[name] = getattr(ns, name)
    if ns.vram_budget is not None:  # an empty one too: the engine says what is wrong with it
        kwargs["vram_budget"] = ns.vram_budget
    elif ns.cache_slots is not None:
        kwargs["expert_cache_slots"] = ns.cache_slots
    elif not ns.all_resident:
        fraction = ns.cache_fraction if ns.cache_fraction is not None else 0.25
        if not 0 < fraction <= 1:
            raise MoEPrefetchError(f"--cache-fraction must lie in (0, 1], got {fraction}")
        kwargs["expert_cache_fraction"] = fraction
    return kwargs


def _serve(ns: argparse.Namespace) -> int:
    try:
        import uvicorn  # noqa: F401  (the extra's presence, checked before the engine loads)

        from .serve.app import build_app
        from .serve.guards import default_allowed_hosts
        from .serve.lifecycle import (DrainingServer, freeze_loaded_objects, listen_problem, server_config,
                                      thaw_loaded_objects)
    except ImportError:
        raise MoEPrefetchError("serving needs the optional extra: pip install -e \".[serve]\"") from None
    from .engine import MoEPrefetchEngine
    from .options import EngineConfig

    for name, value, low in (("--port", ns.port, 1), ("--max-queue", ns.max_queue, 1),
                             ("--max-tokens", ns.max_tokens, 1), ("--max-body-bytes", ns.max_body_bytes, 1),
                             ("--prefill-tokens-per-step", ns.prefill_tokens_per_step, 1)):
        if value < low or (name == "--port" and value > 65535):
            raise MoEPrefetchError(f"{name} {value} is out of range")
    for name, value in (("--drain-seconds", ns.drain_seconds), ("--body-timeout", ns.body_timeout)):
        if not value >= 0 or (name == "--body-timeout" and value == 0):
            raise MoEPrefetchError(f"{name} must be a positive number of seconds, got {value}")
    if not 0 <= ns.admit_wait_ms <= 1000:
        raise MoEPrefetchError(f"--admit-wait-ms must be from 0 to 1000 milliseconds, got {ns.admit_wait_ms}")
    hosts = default_allowed_hosts(ns.host) if ns.allowed_hosts is None else \
        [h.strip() for h in ns.allowed_hosts.split(",") if h.strip()]
    if hosts == []:
        raise MoEPrefetchError("--allowed-hosts names no host: give names, or '*' for any")
    if ns.model_name is not None and not ns.model_name.strip():
        raise MoEPrefetchError("--model-name must not be empty: clients send it as the request's model")
    if ns.api_key is not None and not ns.api_key.strip():  # `--api-key "$KEY"` with KEY unset: not an open server
        raise MoEPrefetchError("the API key (--api-key or $MOEPREFETCH_API_KEY) is empty: give a key, or leave both "
                               "out to serve without one")
    kwargs = _engine_kwargs(ns)
    if (ns.bypass or ns.reuse_weight) and "learned" not in (ns.predictor or "none").split("+"):  # before the load
        raise MoEPrefetchError("--bypass and --reuse-weight act on the learned routing head's predictions, which the "
                               "server's predictor must run: add --predictor learned (or a combination with it)")
    if kwargs["distributed"]:
        raise MoEPrefetchError("serve runs in one process: --distributed is for generate (the ranks would need one "
                               "scheduler between them)")
    if problem := listen_problem(ns.host, ns.port):  # before the engine loads (seconds to minutes)
        raise MoEPrefetchError(problem)
    kwargs.setdefault("max_batch_size", 8)
    engine = MoEPrefetchEngine.from_pretrained(ns.path, config=EngineConfig.from_mapping(kwargs))
    name = ns.model_name or Path(ns.path).resolve().name
    app = build_app(engine, name, ns.predictor, ns.max_queue, ns.drain_seconds, ns.max_tokens, api_key=ns.api_key,
                    allowed_hosts=hosts, max_body_bytes=ns.max_body_bytes, body_timeout=ns.body_timeout,
                    batch_invariant=ns.batch_invariant, prefill_tokens_per_step=ns.prefill_tokens_per_step,
                    admit_wait=ns.admit_wait_ms / 1000)
    print(f"serving {name} on http://{ns.host}:{ns.port}/v1 (batch {engine.options.max_batch_size}"
          f"{', API key required' if ns.api_key else ''})", flush=True)
    # uvicorn re-raises the signals it handled to the handlers it found when it stops: no-op ones, so that the
    # shutdown (drained, or cut by a second signal) ends here
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    # the drain runs before uvicorn's own shutdown (DrainingServer): uvicorn then waits only for the answers
    config = server_config(app, ns.host, ns.port, "info" if ns.verbose else "warning", ns.body_timeout)
    server = DrainingServer(config, app.state.server)
    freeze_loaded_objects()  # the engine lives as long as this server
    try:
        server.run()
    finally:
        thaw_loaded_objects()
    engine.close()
    if server.force_exit:
        print("stopped: a second signal cut the requests in flight", flush=True)
        return EXIT_INTERRUPTED
    print("drained and stopped", flush=True)
    return 0


def _check_writable(path: Path, flag: str) -> None:
    """A file this flag will write must be writable: checked before the work that produces it."""
    if path.expanduser().is_dir():
        raise MoEPrefetchError(f"{flag} {path} is a directory: give a file name")
    parent = path.expanduser().resolve().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise MoEPrefetchError(f"{flag} {path} cannot be written: {parent} is not a writable directory")


def _report(ns: argparse.Namespace) -> int:
    from .report import ReportError, write_report

    results = Path(ns.results)
    if not results.is_file():
        raise MoEPrefetchError(f"{results} is not a file: give a sweep's results.jsonl or a --stats-json file")
    try:
        out = write_report(results, Path(ns.out) if ns.out else None)
    except ReportError as exc:
        raise MoEPrefetchError(str(exc)) from None
    print(f"wrote {out}")
    return 0


def _replay(ns: argparse.Namespace) -> int:
    from .replay import floors, replay, result_rows, setups
    from .traces import load_trace

    if ns.json:
        _check_writable(Path(ns.json), "--json")
    trace = load_trace(ns.trace, ns.experts)
    if ns.tokens is not None:
        if ns.tokens < 1:
            raise MoEPrefetchError(f"--tokens must be a positive number of tokens, got {ns.tokens}")
        trace = trace.head(ns.tokens)
    try:
        aheads = tuple(int(a) for a in ns.ahead.split(",") if a.strip())
        if any(not 1 <= a <= 64 for a in aheads):
            raise ValueError
    except ValueError:
        raise MoEPrefetchError(f"--ahead must be a comma list of token counts from 1 to 64, got {ns.ahead!r}") from None
    if not 0 < ns.expert_mb <= 1e6:  # NaN fails this too
        raise MoEPrefetchError(f"--expert-mb must be a size in MB from above 0 to 1e6, got {ns.expert_mb}")
    runs = setups(ns.slots, ns.policy.split(","), ns.predictor.split(","), ns.fills, halflife=ns.lrfu_halflife,
                  expert_bytes=int(ns.expert_mb * 1e6))
    for setup in runs:  # every setup checked before the first (slow) replay
        setup.check(trace)
    print(f"{trace.source}: {trace.tokens} tokens, {len(trace.layers)} MoE layers x {trace.n_experts} experts, "
          f"top-{trace.top_k}; {ns.slots} slots ({ns.slots / (len(trace.layers) * trace.n_experts):.1%})")
    results = [replay(trace, setup) for setup in runs]
    uses = results[0].uses if results else sum(len(s) for s in trace.steps())
    rows = result_rows(results, floors(trace, ns.slots, aheads), uses)
    print(f"{'':52s} {'hits':>7s} {'misses/token':>13s} {'MB/token':>9s} {'fills':>7s} {'wasted':>7s}")
    for row in rows:
        fills = "" if row["fills"] is None else str(row["fills"])
        wasted = "" if row["wasted_fills"] is None else str(row["wasted_fills"])
        print(f"{row['row']:52s} {row['hit_rate']:7.1%} {row['misses_per_token']:13.1f} {row['mb_per_token']:9.0f} "
              f"{fills:>7s} {wasted:>7s}")
    if ns.json:
        Path(ns.json).write_text(json.dumps({"trace": trace.source, "tokens": trace.tokens, "slots": ns.slots,
                                             "rows": rows}, indent=1))
    return 0


def _train_predictor(ns: argparse.Namespace) -> int:
    from .predictor_training import TrainSettings, format_table, train_predictor

    if ns.json:
        _check_writable(Path(ns.json), "--json")
    flag, files = ("--text", ns.text) if ns.text else ("--ids", ns.ids)
    for name in files:
        if not Path(name).is_file():
            raise MoEPrefetchError(f"{flag} {name} is not a file")
    if not Path(ns.path).is_dir():
        raise MoEPrefetchError(f"checkpoint {ns.path} is not a directory")
    settings = TrainSettings(leads=ns.leads, steps=ns.steps, eval_share=ns.eval_share, max_tokens=ns.max_tokens,
                             horizon=TrainSettings.horizon if ns.horizon is None else ns.horizon,
                             record_dtype=ns.dtype)
    source = [Path(t) for t in ns.text] if ns.text else [t for name in ns.ids for t in _read_ids(Path(name))]
    result = train_predictor(ns.path, source, ns.out, device=ns.device, settings=settings,
                             progress=True, resume=not ns.no_resume)
    print(format_table(result))
    print(f"wrote {result['out']} ({result['params']} parameters, rank {result['rank']}; steps "
          f"{result['start_step']}..{result['steps']})")
    if ns.json:
        Path(ns.json).write_text(json.dumps(result, indent=1))
    return 0


def _read_ids(path: Path) -> list[int]:
    """A token-id file (`--ids`): a .npy array of integers, or text of integers separated by spaces, commas or
    newlines."""
    if path.suffix == ".npy":
        import numpy as np

        try:
            array = np.load(path, allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise MoEPrefetchError(f"--ids {path} is not a readable .npy array ({exc})") from None
        if array.dtype.kind not in "iu":
            raise MoEPrefetchError(f"--ids {path} holds {array.dtype} values, not integer token ids")
        return [int(t) for t in array.reshape(-1)]
    try:
        words = path.read_text(encoding="utf-8").replace(",", " ").split()
        return [int(w) for w in words]
    except (UnicodeDecodeError, ValueError):
        raise MoEPrefetchError(f"--ids {path} is not a list of integer token ids (separated by spaces, commas or "
                               f"newlines), nor a .npy array") from None


def _info(ns: argparse.Namespace) -> int:
    from .checkpoint import CheckpointReader
    from .config import load_model_args

    args = load_model_args(ns.path)
    reader = CheckpointReader(ns.path)
    has_mtp = any(name.startswith(f"model.layers.{args.mtp_layer_index}.") for name in reader.tensors)
    expert_bytes = 3 * args.hidden_size * args.moe_intermediate_size * 2
    moe_layers = len(args.moe_layers) + (1 if has_mtp else 0)
    heads = (f"{args.num_attention_heads} query / {args.num_key_value_heads} key-value heads of {args.qk_head_dim}"
             if args.attention == "gqa" else f"{args.num_attention_heads} heads, latent {args.kv_lora_rank}")
    print(f"{ns.path}: {args.model_type}, {args.num_hidden_layers} layers ({len(args.moe_layers)} MoE), hidden "
          f"{args.hidden_size}, vocab {args.vocab_size}; {args.attention.upper()} attention, {heads}")
    print(f"routed experts: {args.n_routed_experts} per layer, top-{args.num_experts_per_tok}, "
          f"{args.n_shared_experts} shared; router {args.scoring_func}/{args.topk_method}, groups "
          f"{args.n_group}/{args.topk_group}")
    print(f"MTP layer: {'present (model.layers.%d)' % args.mtp_layer_index if has_mtp else 'absent'}")
    print(f"experts: {moe_layers * args.n_routed_experts} x {expert_bytes / 1e6:.2f} MB as bf16 records = "
          f"{moe_layers * args.n_routed_experts * expert_bytes / 1e9:.2f} GB (whatever the checkpoint stores; "
          f"--expert-dtype fp8 halves the records, int4 makes them about a quarter); checkpoint "
          f"{reader.total_bytes() / 1e9:.2f} GB on disk")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    ns.verbose = getattr(ns, "verbose", False)
    logging.basicConfig(level=logging.INFO if ns.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    if not ns.verbose:
        logging.getLogger("transformers").setLevel(logging.ERROR)
    handlers = {"generate": _generate, "report": _report, "info": _info, "serve": _serve, "replay": _replay,
                "train-predictor": _train_predictor}
    try:
        return handlers[ns.command](ns)
    except MoEPrefetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as exc:
        print(f"error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
