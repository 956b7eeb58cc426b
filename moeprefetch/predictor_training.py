"""Training a learned routing predictor (`learned_predictor.RoutingHead`) from a checkpoint's own routing: the
checkpoint runs over the user's text (`routing_record.py` records each token's hidden states and experts), samples
pair what step t knows with the experts of tokens t+1 .. t+leads, and the head is fitted, evaluated on held-out
windows and saved with the checkpoint's fingerprint (`moeprefetch train-predictor`).

Above the engine in the import order: it opens one to record. The head and its loading stay in
`learned_predictor.py`, which the engine's build reads.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .checkpoint import checkpoint_fingerprint
from .config import load_model_args
from .engine import MoEPrefetchEngine
from .errors import CheckpointError, RequestError
from .learned_predictor import BYTE_SHARE, HeadConfig, RoutingHead, fitting_rank, logit_blocks, save_predictor
from .requests import check_token_range
from .routing_record import RoutingRecord, record_routing

logger = logging.getLogger(__name__)


# ---- samples ------------------------------------------------------------------------------------------------------


def sample_index(record: RoutingRecord, leads: int) -> torch.Tensor:
    """Tokens t whose targets t+1..t+leads lie in the same window (and so do their MTP inputs); `leads` is the
    farthest target, the horizon's too."""
    n = record.tokens
    t = torch.arange(n)
    last = torch.clamp(t + leads, max=n - 1)
    return t[(t + leads < n) & (record.window[last] == record.window)]


def targets(record: RoutingRecord, index: torch.Tensor, leads: int, n_experts: int, horizon: int = 0) -> torch.Tensor:
    """Multi-hot [S, leads, L, E] float: the experts each layer of token t+j used, j = 1..leads; with a horizon, one
    more block [S, 1, L, E]: the experts used by any of tokens t+1..t+horizon (scattered token by token into one
    block, so a long horizon costs no more memory than a short one)."""
    out = torch.zeros(index.numel(), logit_blocks(leads, horizon), record.ids.shape[1], n_experts)
    for j in range(1, max(leads, horizon) + 1):
        ids = record.ids[index + j]  # [S, L, k]
        if j <= leads:
            out[:, j - 1].scatter_(-1, ids, 1.0)
        if j <= horizon:
            out[:, -1].scatter_(-1, ids, 1.0)
    return out


def split_windows(record: RoutingRecord, index: torch.Tensor, eval_share: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) samples, split by window (the last `eval_share` of windows): neighbouring tokens of one
    window share their context, so a token-level split would leak."""
    windows = int(record.window.max()) + 1
    held = max(1, round(windows * eval_share))
    if held >= windows:
        raise RequestError(f"the text makes {windows} window(s): too few to hold out {eval_share:.0%} for "
                           f"evaluation; give more text")
    cut = windows - held
    mine = record.window[index]
    return index[mine < cut], index[mine >= cut]


# ---- metrics ------------------------------------------------------------------------------------------------------


def _set_metrics(guess: torch.Tensor, truth: torch.Tensor) -> tuple[list[float], list[float]]:
    """guess [S, L, g], truth [S, L, k] ids -> per-layer (recall, precision) lists."""
    hits = (guess[..., :, None] == truth[..., None, :]).any(-1).sum(-1).float()  # [S, L]
    recall = (hits / truth.shape[-1]).mean(0)
    precision = (hits / guess.shape[-1]).mean(0)
    return recall.tolist(), precision.tolist()


def _row(name: str, lead: int, k: int, guess: torch.Tensor, truth: torch.Tensor) -> dict[str, Any]:
    recall, precision = _set_metrics(guess, truth)
    return {"predictor": name, "lead": lead, "guesses": k, "recall": sum(recall) / len(recall),
            "precision": sum(precision) / len(precision), "recall_per_layer": recall,
            "precision_per_layer": precision}


@torch.no_grad()
def evaluate(head: RoutingHead, record: RoutingRecord, index: torch.Tensor, batch: int = 8192) -> dict[str, Any]:
    """Recall and precision of the head's top-k and top-2k guesses per layer and lead on tokens `index`, next to
    the baselines on the same tokens: `previous` (token t's routing as the guess for t+1, t+j), `mtp_router` (each
    main router on the MTP output, for t+1, top-k and top-2k by its selection scores) when recorded, and chance."""
    c = head.config
    head.eval()
    k = c.top_k
    logits = torch.cat([head(record.hidden[i], None if record.mtp_hidden is None else record.mtp_hidden[i])
                        for i in index.split(batch)])
    rows: list[dict[str, Any]] = []
    for lead in range(1, c.leads + 1):
        truth = record.ids[index + lead]
        ranked = logits[:, lead - 1].topk(min(2 * k, c.n_experts), dim=-1).indices
        rows.append(_row("learned", lead, k, ranked[..., :k], truth))
        rows.append(_row("learned", lead, ranked.shape[-1], ranked, truth))
        rows.append(_row("previous", lead, k, record.ids[index], truth))
        if record.mtp_router is not None and lead == 1:
            rows.append(_row("mtp_router", lead, k, record.mtp_router[index][..., :k], truth))
            rows.append(_row("mtp_router", lead, record.mtp_router.shape[-1], record.mtp_router[index], truth))
        rows.append({"predictor": "chance", "lead": lead, "guesses": k, "recall": k / c.n_experts,
                     "precision": k / c.n_experts})
    result = {"tokens": int(index.numel()), "layers": list(c.layers), "experts": c.n_experts, "top_k": k,
              "mtp_router": "recorded" if record.mtp_router is not None else
              "skipped: the checkpoint has no MTP layer", "rows": rows}
    if c.horizon:
        result["horizon"] = _horizon_metrics(logits[:, -1], record, index, c, batch)
    return result


def _horizon_metrics(logits: torch.Tensor, record: RoutingRecord, index: torch.Tensor, c: HeadConfig,
                     batch: int) -> dict[str, Any]:
    """The horizon block against the experts each layer really used within `horizon` tokens: precision and recall
    of the guesses with p > 0.5, and how many experts a layer needs in that time (in batches of samples)."""
    hits = guessed = needed = 0
    for rows in torch.arange(index.numel()).split(batch):
        truth = targets(record, index[rows], 1, c.n_experts, c.horizon)[:, -1] > 0
        guess = logits[rows] > 0
        hits += int((guess & truth).sum())
        guessed += int(guess.sum())
        needed += int(truth.sum())
    cells = index.numel() * len(c.layers)
    return {"horizon": c.horizon, "needed_per_layer": needed / cells, "guessed_per_layer": guessed / cells,
            "precision_at_half": hits / max(guessed, 1), "recall_at_half": hits / max(needed, 1)}


def format_table(result: dict[str, Any]) -> str:
    """The evaluation as a text table (one line per predictor, lead and guess count)."""
    layers = result["layers"]
    head = f"{'predictor':12s} {'lead':>4s} {'guesses':>7s} {'recall':>7s} {'precision':>9s}  recall per layer " \
           f"{layers}"
    lines = [f"held-out tokens: {result['tokens']}, top-{result['top_k']} of {result['experts']} experts", head]
    for row in result["rows"]:
        per = " ".join(f"{v:.3f}" for v in row.get("recall_per_layer", []))
        lines.append(f"{row['predictor']:12s} {row['lead']:4d} {row['guesses']:7d} {row['recall']:7.3f} "
                     f"{row['precision']:9.3f}  {per}")
    if "horizon" in result:
        h = result["horizon"]
        lines.append(f"needed within {h['horizon']} tokens: {h['needed_per_layer']:.1f} experts a layer; guessed at "
                     f"p > 0.5: {h['guessed_per_layer']:.1f}, precision {h['precision_at_half']:.3f}, recall "
                     f"{h['recall_at_half']:.3f}")
    return "\n".join(lines)


# ---- training -----------------------------------------------------------------------------------------------------

MIN_WINDOW = 16  # shorter windows teach little: most of their tokens sit at the start of a context


@dataclass(frozen=True)
class TrainSettings:
    leads: int = 1
    steps: int = 1500
    batch: int = 2048
    lr: float = 3e-3
    weight_decay: float = 0.01
    window: int = 512
    eval_share: float = 0.1
    max_tokens: int = 1 << 20  # of training text (recording runs the whole model over every token)
    seed: int = 0
    save_every: int = 250
    use_mtp: bool = True  # feed the MTP output too, when the checkpoint has an MTP layer
    # > 0: also learn "needed by any of the next `horizon` tokens" (victims' reuse, `reuse_weight`). 8: on the deep
    # benchmark model (CPU, 518 slots, sampled, bypass) protection by a head of leads 1 and horizon 8 moved 13.2 %
    # fewer experts than reactive; heads of leads 2 ranking by their leads' probabilities 10.4 %, by 16 tokens 11.2 %
    # (BENCHMARKS "Protection that moves fewer bytes than reactive"). The CLI's help says 8 too.
    horizon: int = 8
    # the compute dtype the routing is recorded in (default: the engine's on that device, bf16 on CUDA and fp32 on
    # the CPU): the one decode runs in, whose routing of the same tokens differs slightly from fp32's
    record_dtype: str | None = None


def _token_stream(engine: "MoEPrefetchEngine", texts_or_ids: Any, max_tokens: int) -> list[int]:
    """Text files (Path), texts (str) or token ids (ints, an array or a tensor) -> one token stream, at most
    `max_tokens` long."""
    if isinstance(texts_or_ids, torch.Tensor) or hasattr(texts_or_ids, "dtype"):
        ids = [int(t) for t in list(texts_or_ids.reshape(-1)[:max_tokens])]
        check_token_range(ids, engine.args)
        return ids
    items = list(texts_or_ids)
    if items and all(isinstance(t, int) for t in items):
        check_token_range(items[:max_tokens], engine.args)
        return items[:max_tokens]
    if engine.tokenizer is None:
        raise RequestError("training on text needs the checkpoint's tokenizer, and this checkpoint has none; give "
                           "token ids instead (the command line's --ids)")
    stream: list[int] = []
    for item in items:
        if isinstance(item, Path):
            if not item.is_file():
                raise RequestError(f"text file {item} does not exist")
            try:
                with item.open(encoding="utf-8") as handle:
                    item = handle.read(max(0, max_tokens - len(stream)) * 8)  # ~4 characters per token, twice over
            except UnicodeDecodeError:
                raise RequestError(f"text file {item} is not UTF-8 text: the routing is recorded over text") from None
        stream += list(engine.tokenizer(item, add_special_tokens=False)["input_ids"])
        if len(stream) >= max_tokens:
            break
    return stream[:max_tokens]


def _windows(stream: list[int], window: int, leads: int) -> list[list[int]]:
    """Consecutive windows (a short tail is dropped when it could not hold a sample)."""
    chunks = [stream[i:i + window] for i in range(0, len(stream), window)]
    return [c for c in chunks if len(c) >= max(MIN_WINDOW, leads + 2)]


def _check_inputs(checkpoint: Path, out_path: Path, settings: TrainSettings) -> None:

    if out_path.is_dir():
        raise RequestError(f"the predictor cannot be written to {out_path}: it is a directory; give a file name "
                           f"(predictor.safetensors)")
    if not out_path.parent.is_dir():
        raise RequestError(f"the predictor cannot be written to {out_path}: directory {out_path.parent} does not "
                           f"exist")
    if out_path.suffix != ".safetensors":  # the file is safetensors whatever its name: say so in the name
        raise RequestError(f"the predictor is a safetensors file: name it *.safetensors, not {out_path.name}")
    if not 1 <= settings.leads <= 8:
        raise RequestError(f"leads must lie in 1..8, got {settings.leads}")
    if not 0 <= settings.horizon <= 64:
        raise RequestError(f"horizon must lie in 0..64 tokens, got {settings.horizon}")
    if settings.steps < 1:  # no step would save an untrained head
        raise RequestError(f"steps must be >= 1, got {settings.steps}")
    if not 0 < settings.eval_share < 1:
        raise RequestError(f"eval_share must lie in (0, 1), got {settings.eval_share}")
    if not load_model_args(checkpoint).moe_layers:
        raise CheckpointError(f"checkpoint {checkpoint} has no MoE layers: there is no routing to predict")


def _record(engine: "MoEPrefetchEngine", stream: list[int], settings: TrainSettings, progress: bool,
            what: str) -> RoutingRecord:

    window = min(settings.window, engine.args.max_position_embeddings)
    windows = _windows(stream, window, max(settings.leads, settings.horizon))
    if len(windows) < (1 if what == "held-out" else 2):
        raise RequestError(f"the {what} text is too short to train on: {len(stream)} tokens make {len(windows)} "
                           f"window(s) of >= {max(MIN_WINDOW, max(settings.leads, settings.horizon) + 2)} tokens")
    logger.info("recording routing of %d %s tokens in %d windows", sum(map(len, windows)), what, len(windows))
    return record_routing(engine, windows, progress=progress)


def _resume_path(out_path: Path) -> Path:
    return out_path.with_name(out_path.name + ".resume.pt")


def _check_resume(out_path: Path, data_key: str, settings: TrainSettings) -> None:
    """A resume state beside `out_path` must be of these training tokens and a step count not past `settings`':
    checked before the routing is recorded (minutes on a large checkpoint), not after."""
    state_path = _resume_path(out_path)
    if not state_path.is_file():
        return
    state = torch.load(state_path, map_location="cpu", weights_only=False)
    if state.get("data", "") != data_key:
        raise RequestError(f"resume state {state_path} was trained on other tokens (other text, or another "
                           f"max_tokens); delete it or train with resume=False (--no-resume)")
    if state["step"] > settings.steps:
        raise RequestError(f"resume state {state_path} is at step {state['step']}, past steps={settings.steps}: "
                           f"ask for more steps, or train with resume=False (--no-resume)")


def _fit(head: RoutingHead, record: RoutingRecord, train: torch.Tensor, settings: TrainSettings, out_path: Path,
         resume: bool, progress: bool, data_key: str = "") -> int:
    """AdamW on BCE over the multi-hot expert sets, from the resume state next to `out_path` if there is one (of
    the same setup, checked here; its tokens, `data_key`, and step were checked before recording) -> the step it
    started from. Batches are drawn by a generator
    seeded per step, so a resumed run draws what an uninterrupted one would."""
    from tqdm.auto import tqdm

    opt = torch.optim.AdamW(head.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * max(
        0.05, 1 - s / max(settings.steps, 1)))  # warm-up, then linear decay
    state_path, start = _resume_path(out_path), 0
    if resume and state_path.is_file():
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        if state["config"] != head.config.to_json():
            raise RequestError(f"resume state {state_path} belongs to another predictor setup; delete it or train "
                               f"with resume=False (--no-resume)")
        head.load_state_dict(state["head"])  # its tokens and step were checked before recording (_check_resume)
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start = state["step"]
        logger.info("resuming training at step %d of %d", start, settings.steps)
    c = head.config
    head.train()
    bar = tqdm(range(start, settings.steps), desc="training predictor", unit="step", disable=not progress,
               initial=start, total=settings.steps, leave=False)
    for step in bar:
        gen = torch.Generator().manual_seed(settings.seed * 1_000_003 + step)
        pick = train[torch.randint(train.numel(), (min(settings.batch, train.numel()),), generator=gen)]
        logits = head(record.hidden[pick], None if record.mtp_hidden is None else record.mtp_hidden[pick])
        loss = F.binary_cross_entropy_with_logits(logits, targets(record, pick, c.leads, c.n_experts, c.horizon))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
        if (step + 1) % settings.save_every == 0 or step + 1 == settings.steps:
            torch.save({"config": c.to_json(), "head": head.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "step": step + 1, "data": data_key}, state_path)
    head.eval()
    return start


def _head_config(engine: "MoEPrefetchEngine", settings: TrainSettings, use_mtp: bool) -> HeadConfig:
    from .weights import weights_nbytes

    args = engine.args
    layers = tuple(lw.index for lw in engine.weights.layers if lw.router is not None)
    # the checkpoint's non-expert bytes as stored (bf16 for most), whatever dtype the engine computes in
    non_expert = weights_nbytes(engine.weights) // engine.weights.embed.element_size() * 2
    outputs = logit_blocks(settings.leads, settings.horizon) * len(layers) * args.n_routed_experts
    rank = fitting_rank(args.hidden_size * (2 if use_mtp else 1), outputs, int(BYTE_SHARE * non_expert))
    return HeadConfig(hidden_size=args.hidden_size, layers=layers, n_experts=args.n_routed_experts,
                      top_k=args.num_experts_per_tok, leads=settings.leads, rank=rank, use_mtp=use_mtp,
                      horizon=settings.horizon,
                      fingerprint=checkpoint_fingerprint(engine.path))


def train_predictor(checkpoint: str | Path, texts_or_ids: Any, out_path: str | Path, leads: int = 1,
                    steps: int = 1500, device: str = "cpu", progress: bool = True, resume: bool = True,
                    eval_ids: Any = None, settings: TrainSettings | None = None,
                    engine: "MoEPrefetchEngine | None" = None) -> dict[str, Any]:
    """Record the checkpoint's routing over the text, train a `RoutingHead`, evaluate it on held-out windows (the
    last `eval_share` of the text, or `eval_ids` when given) and save it to `out_path` -> the evaluation and
    training facts. `settings`, when given, replaces `leads` and `steps`; `device` is where the checkpoint runs to
    record (the head itself is small enough to train on the CPU); `engine` reuses a loaded engine of `checkpoint`.
    With `resume`, a resume state next to `out_path` (`<out>.resume.pt`, written every `save_every` steps) continues
    at its step; recording is deterministic, so a resumed run sees the same samples."""
    import time

    checkpoint, out_path = Path(checkpoint), Path(out_path)
    settings = settings or TrainSettings(leads=leads, steps=steps)
    _check_inputs(checkpoint, out_path, settings)
    began = time.monotonic()
    owned = engine is None
    if engine is None:
        dtype = settings.record_dtype or ("bfloat16" if str(device).startswith("cuda") else "float32")
        engine = MoEPrefetchEngine.from_pretrained(checkpoint, device=device, dtype=dtype,
                                                   max_batch_size=1)
    try:
        stream = _token_stream(engine, texts_or_ids, settings.max_tokens)
        # what a resume state must have been trained on: these training tokens
        data_key = hashlib.sha256(torch.tensor(stream, dtype=torch.int64).numpy().tobytes()).hexdigest()
        if resume:
            _check_resume(out_path, data_key, settings)
        record = _record(engine, stream, settings, progress, "training")
        reach = max(settings.leads, settings.horizon)
        index = sample_index(record, reach)
        if eval_ids is None:
            train, held = split_windows(record, index, settings.eval_share)
            held_record = record
        else:
            train = index
            held_record = _record(engine, _token_stream(engine, eval_ids, settings.max_tokens), settings, progress,
                                  "held-out")
            held = sample_index(held_record, reach)
        if not settings.use_mtp:  # the head sees the final hidden state only (mtp_router stays a baseline)
            record.mtp_hidden = held_record.mtp_hidden = None
        with torch.random.fork_rng(devices=[]):  # the head's initial weights from `seed`: a run repeats exactly
            torch.default_generator.manual_seed(settings.seed)  # the CPU's only: the head is made there
            head = RoutingHead(_head_config(engine, settings, record.mtp_hidden is not None))
    finally:
        if owned:
            engine.close()
    recorded = time.monotonic()
    start = _fit(head, record, train, settings, out_path, resume, progress, data_key)
    result = evaluate(head, held_record, held)
    facts = {"train_samples": int(train.numel()), "start_step": start, "steps": settings.steps,
             "params": sum(p.numel() for p in head.parameters()), "rank": head.config.rank,
             "record_seconds": round(recorded - began, 1), "train_seconds": round(time.monotonic() - recorded, 1)}
    save_predictor(head, out_path, {**facts, "heldout_tokens": result["tokens"]})
    return {**result, **facts, "out": str(out_path)}
