"""Token selection on the device: greedy, or temperature / top-k / top-p sampling with counter-based noise; logit
bias and presence / frequency penalties before either; the chosen token's log-probability and the most likely
alternatives beside it.

Each sampled token uses Gumbel noise computed from a hash of (seed, sequence index, position, vocabulary index) with
integer arithmetic, so it needs no generator state: it runs inside a CUDA graph, and the token drawn at a position
depends only on its logits. On CUDA the noise and its arg-max are one kernel (`kernels/sampling.py`), elsewhere its
torch reference, which the kernel matches. A sequence draws the same tokens whatever runs beside it, and with
speculative as with plain decoding; the sequence index is the prompt's place in its call, so the same prompt at
another place draws other tokens (n samples of one prompt differ).

Bias and penalties (OpenAI's and vLLM's meaning) change the logits every choice is made from, greedy included:
logits + bias - presence * [token generated before] - frequency * (times generated before), counting the call's
generated tokens only (not the prompt's). Log-probabilities are the model's own: log-softmax of the raw logits,
before bias, penalties, temperature and filtering (vLLM's default), so they say what the model thinks of a token
whatever a request did to choose it.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass

import torch

from .errors import RequestError
from .kernels import kernels_usable
from .kernels.sampling import gumbel_argmax, pcg

LOGPROBS_MAX = 20  # most alternatives a request may ask for (OpenAI's top_logprobs limit)
LOGIT_BIAS_LIMIT = 100.0  # |bias| per token, as OpenAI bounds it
PENALTY_LIMIT = 2.0  # |presence_penalty|, |frequency_penalty|, as OpenAI bounds them
# the largest temperature: far past any useful one (logits divided by it draw near-uniformly), and within fp32, which
# the sampler divides the logits in (a larger value overflowed to a traceback)
TEMPERATURE_LIMIT = 1e6
# seeds are 64-bit signed integers, as OpenAI's and vLLM's: the sampler hashes all 64 bits (`seed_halves`)
SEED_MIN, SEED_LIMIT = -(2**63), 2**63


def seed_halves(seed: int) -> tuple[int, int]:
    """The seed's two 32-bit words as the sampler's hash takes them: bits 0-30 and 31-61 in the words' low 31 bits (as
    the sampler always hashed seeds below 2**62, whose draws stay as they were), bits 62 and 63 of its two's
    complement in the words' top bits. Distinct 64-bit seeds give distinct words."""
    bits = seed & ((1 << 64) - 1)
    low, high = bits & ((1 << 31) - 1), (bits >> 31) & ((1 << 31) - 1)
    return high | ((bits >> 63) << 31), low | (((bits >> 62) & 1) << 31)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ids ascending (`bias_pairs`)
    presence_penalty: float = 0.0  # subtracted from a token's logit once it was generated in this call
    frequency_penalty: float = 0.0  # subtracted once per time it was generated
    logprobs: int | None = None  # None: no log-probabilities; n: the chosen token's and the n most likely

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalises(self) -> bool:
        """Whether tokens drawn so far change the next draw (a verify step, drawing two at once, cannot)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def adjusts(self) -> bool:
        """Whether the logits are biased or penalised before the choice."""
        return bool(self.logit_bias) or self.penalises

    def validate(self, vocab: int | None = None) -> None:
        """One `RequestError` sentence for the first bad field; `vocab` bounds logit_bias's token ids."""
        self._validate_sampling()
        for token, bias in self.logit_bias:
            if not isinstance(token, int) or isinstance(token, bool) or token < 0 \
                    or (vocab is not None and token >= vocab):
                where = f" [0, {vocab})" if vocab is not None else ""
                raise RequestError(f"logit_bias names token {token!r}, which is not a token id of the vocabulary{where}")
            if not _finite_number(bias) or abs(bias) > LOGIT_BIAS_LIMIT:
                raise RequestError(f"logit_bias for token {token} must be a number in [-{LOGIT_BIAS_LIMIT:g}, "
                                   f"{LOGIT_BIAS_LIMIT:g}], got {bias!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _finite_number(value) or abs(value) > PENALTY_LIMIT:
                raise RequestError(f"{name} must be a number in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}], got {value!r}")
        n = self.logprobs
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= LOGPROBS_MAX):
            raise RequestError(f"logprobs must be None or an integer in [0, {LOGPROBS_MAX}] (alternatives per token), "
                               f"got {n!r}")

    def _validate_sampling(self) -> None:
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise RequestError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _finite_number(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature > TEMPERATURE_LIMIT:  # the sampler divides fp32 logits by it
            raise RequestError(f"temperature must be at most {TEMPERATURE_LIMIT:g}, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if (
            not isinstance(self.top_p, (int, float))
            or isinstance(self.top_p, bool)
            or not _finite_number(self.top_p)
            or not 0 < self.top_p <= 1
        ):
            raise RequestError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not SEED_MIN <= self.seed < SEED_LIMIT:
            raise RequestError(f"seed must be an integer in [-2**63, 2**63) (64 bits, signed), got {self.seed!r}")


def _finite_number(value: object) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer beyond any float
        return False


def bias_pairs(logit_bias: object) -> tuple[tuple[int, float], ...]:
    """A logit_bias argument ({token id: bias}, ids as ints or as the decimal strings JSON keys are; None or {} for
    none) -> the sorted pairs `SamplingParams` holds; one `RequestError` sentence for another shape. Values are
    checked by `SamplingParams.validate`."""
    if logit_bias is None:
        return ()
    if not isinstance(logit_bias, dict):
        raise RequestError(f"logit_bias must be a mapping of token id to bias, got {type(logit_bias).__name__}")
    pairs = {}
    for key, bias in logit_bias.items():
        token = key
        # a token id has at most a few digits: longer strings (int() refuses beyond 4,300) name no token
        if isinstance(key, str) and re.fullmatch(r"\s*-?[0-9]{1,18}\s*", key, flags=re.ASCII):
            token = int(key)
        if not isinstance(token, int) or isinstance(token, bool):
            raise RequestError(f"logit_bias keys must be token ids (integers), got {key!r}")
        if token in pairs:
            raise RequestError(f"logit_bias names token {token} twice")
        pairs[token] = float(bias) if _finite_number(bias) else bias  # what is not a finite number: validate says
    return tuple(sorted(pairs.items()))


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's log-probability under the model and the most likely tokens at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-probability), most likely first, as many as were asked

    def first(self, n: int) -> "TokenLogprob":
        """The same with only the `n` most likely alternatives."""
        return TokenLogprob(self.token, self.logprob, self.top[:n])


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw logits [B, V] and chosen ids [B] -> (values [B, 1 + n] fp32: the chosen token's log-probability, then the
    n most likely tokens', ids [B, n] int64). Fixed shapes: runs inside a captured step."""
    # log-softmax is the logits less their log-sum-exp: the most likely tokens are the largest logits, so the [B, V]
    # log-probabilities are never written (at a 102,400-token vocabulary, one reduction and one top-k)
    logits = logits.float()
    total = logits.logsumexp(dim=-1, keepdim=True)
    top, ids = logits.topk(n, dim=-1)
    return torch.cat((logits.gather(-1, chosen[:, None]), top), dim=-1) - total, ids


def read_logprobs(tokens: list[int], values: list[list[float]], ids: list[list[int]]) -> list[TokenLogprob]:
    """Host lists of `token_logprobs`'s outputs -> one `TokenLogprob` per row."""
    return [TokenLogprob(t, v[0], tuple(zip(i, v[1:]))) for t, v, i in zip(tokens, values, ids)]


def logprobs_of(logits: torch.Tensor, chosen: torch.Tensor, n: int) -> list[TokenLogprob]:
    """Raw logits [B, V] and chosen ids [B] -> each row's `TokenLogprob` with its n most likely alternatives (at
    most V), read to the host now (a prefill's first tokens; decode steps read theirs with the step's outputs)."""
    values, ids = token_logprobs(logits, chosen, min(n, logits.shape[-1]))
    return read_logprobs(chosen.tolist(), values.tolist(), ids.tolist())


class LogitAdjuster:
    """Each row's logit bias and presence / frequency penalties, with the counts of the tokens the row generated, in
    fixed device tensors (captured steps read them; `set_row` writes a request's values before its first draw)."""

    def __init__(self, vocab: int, device: torch.device, rows: int):
        self.bias = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
        self.counts = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
        self.presence = torch.zeros(rows, 1, dtype=torch.float32, device=device)
        self.frequency = torch.zeros(rows, 1, dtype=torch.float32, device=device)

    @property
    def rows(self) -> int:
        return self.bias.shape[0]

    def set_row(self, row: int, params: SamplingParams) -> None:
        """A request's values into `row`, its counts cleared (nothing generated yet)."""
        self.bias[row].zero_()
        if params.logit_bias:
            ids, values = zip(*params.logit_bias)
            self.bias[row, list(ids)] = torch.tensor(values, dtype=torch.float32, device=self.bias.device)
        self.counts[row].zero_()
        self.presence[row] = params.presence_penalty
        self.frequency[row] = params.frequency_penalty

    def count(self, tokens: torch.Tensor, active: torch.Tensor) -> None:
        """tokens [B] just generated (a step's input tokens), active [B] bool: each active row counts its token."""
        rows = tokens.shape[0]
        self.counts[:rows].scatter_add_(1, tokens[:, None], active.to(torch.float32)[:, None])

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] fp32 -> biased and penalised (rows with none of either come back unchanged, bit for bit)."""
        rows = logits.shape[0]
        counts = self.counts[:rows]
        return (logits + self.bias[:rows] - self.presence[:rows] * (counts > 0).to(torch.float32)
                - self.frequency[:rows] * counts)


class DeviceSampler:
    """Sampling with fixed tensors (captured once, replayed every step): the call's parameters live on the device.
    `rows` bounds the rows of a call (the logit adjuster's, made when a call first biases or penalises)."""

    def __init__(self, vocab: int, device: torch.device, rows: int = 1):
        self.vocab = vocab
        self.device = device
        self.max_rows = rows
        self.adjuster: LogitAdjuster | None = None
        self.owner: DeviceSampler | None = None  # a view's sampler (`RowSampler.first_rows`): its adjuster is shared
        self.vocab_hash = pcg(torch.arange(vocab, dtype=torch.int64, device=device))
        self.use_kernels = kernels_usable(device.type)  # the noise and its arg-max in one pass (kernels/sampling.py)
        self.temperature = torch.ones(1, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(1, dtype=torch.int64, device=device)
        self.top_p = torch.ones(1, dtype=torch.float32, device=device)
        self.seed = torch.zeros(2, dtype=torch.int64, device=device)  # `seed_halves`

    def set_params(self, params: SamplingParams) -> None:
        """Before a call: write its parameters into the device tensors (the graphs read them there)."""
        self.temperature.fill_(max(params.temperature, 1e-6))
        self.top_k.fill_(params.top_k if 0 < params.top_k < self.vocab else 0)
        self.top_p.fill_(params.top_p)
        self.seed.copy_(torch.tensor(seed_halves(params.seed)))
        if params.adjusts:
            adjuster = self.logit_adjuster()
            for row in range(adjuster.rows):
                adjuster.set_row(row, params)

    def logit_adjuster(self) -> LogitAdjuster:
        """The rows' bias and penalties, made once (captured steps keep pointing at its tensors)."""
        owner = self.owner or self
        if owner.adjuster is None:
            owner.adjuster = LogitAdjuster(self.vocab, self.device, owner.max_rows)
        return owner.adjuster

    def adjust(self, logits: torch.Tensor) -> torch.Tensor:
        return self.logit_adjuster()(logits.float())

    def draw(self, scaled: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """argmax(scaled + Gumbel noise) -> [B] int64; each row's noise stream is its index, the seed the call's."""
        return gumbel_argmax(scaled, self.vocab_hash, rows, positions, self.seed[0], self.seed[1], self.use_kernels)

    def filter(self, logits: torch.Tensor, use_top_k: bool, use_top_p: bool) -> torch.Tensor:
        """logits [B, V] fp32 -> temperature-scaled, with tokens outside top-k / top-p set to -inf."""
        scaled = logits / self.temperature
        if use_top_k or use_top_p:
            ordered, order = scaled.sort(dim=-1, descending=True)
            if use_top_k:
                kth = ordered.gather(-1, (self.top_k - 1).clamp(min=0).expand(scaled.shape[0], 1))
                scaled = scaled.masked_fill(scaled < kth, float("-inf"))
                ordered = ordered.masked_fill(ordered < kth, float("-inf"))
            if use_top_p:
                probs = ordered.softmax(-1)
                before = probs.cumsum(-1) - probs  # mass strictly before each token
                drop_sorted = before >= self.top_p  # keep the smallest prefix whose mass reaches top_p
                drop_sorted[:, 0] = False  # and the likeliest token always (a top_p below fp32's range reads 0)
                drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
                scaled = scaled.masked_fill(drop, float("-inf"))
        return scaled

    def __call__(self, logits: torch.Tensor, params: SamplingParams, rows: torch.Tensor,
                 positions: torch.Tensor, adjust: bool | None = None) -> torch.Tensor:
        """logits [B, V] -> token ids [B] (int64). `params` decides the graph's shape (greedy, top-k, top-p, and
        bias and penalties unless `adjust` says, on or off); the values come from the device tensors set by
        `set_params`."""
        if params.adjusts if adjust is None else adjust:
            logits = self.adjust(logits)
        if params.greedy:
            return logits.argmax(dim=-1)
        scaled = self.filter(logits.float(), 0 < params.top_k < self.vocab, params.top_p < 1.0)
        return self.draw(scaled, rows, positions)


class RowSampler(DeviceSampler):
    """Each row with its own parameters (a continuous batch: requests with their own temperature, top-k, top-p,
    seed, bias and penalties share a step). A row draws exactly what the same request draws alone through `DeviceSampler` (as row 0 of
    its own call): the same scaled and filtered logits, and noise from (its seed, stream 0, position); greedy rows
    take the argmax."""

    ROW_TENSORS = ("temperature", "greedy", "top_k", "use_top_k", "top_p", "use_top_p", "row_seed")

    def __init__(self, vocab: int, device: torch.device, rows: int):
        super().__init__(vocab, device, rows)
        self.temperature = torch.ones(rows, 1, dtype=torch.float32, device=device)
        self.greedy = torch.ones(rows, dtype=torch.bool, device=device)
        self.top_k = torch.zeros(rows, 1, dtype=torch.int64, device=device)
        self.use_top_k = torch.zeros(rows, 1, dtype=torch.bool, device=device)
        self.top_p = torch.ones(rows, 1, dtype=torch.float32, device=device)
        self.use_top_p = torch.zeros(rows, 1, dtype=torch.bool, device=device)
        self.row_seed = torch.zeros(rows, 2, dtype=torch.int64, device=device)

    def set_row(self, row: int, params: SamplingParams) -> None:
        """Before a request's first step in `row` (a few small copies)."""
        self.temperature[row] = max(params.temperature, 1e-6)
        self.greedy[row] = params.greedy
        use_k = 0 < params.top_k < self.vocab
        self.top_k[row] = params.top_k if use_k else 1
        self.use_top_k[row] = use_k
        self.top_p[row] = params.top_p
        self.use_top_p[row] = params.top_p < 1.0
        self.row_seed[row] = torch.tensor(seed_halves(params.seed))
        if params.adjusts or self.adjuster is not None:  # a row's old bias must not outlive its request
            self.logit_adjuster().set_row(row, params)

    def first_rows(self, rows: int) -> "RowSampler":
        """A sampler of the first `rows` rows whose parameters are views of these (`set_row` here reaches it, and
        the logit adjuster is this one's, whenever it is made)."""
        view = copy.copy(self)
        view.owner = self
        for name in self.ROW_TENSORS:
            setattr(view, name, getattr(self, name)[:rows])
        return view

    def draw(self, scaled: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # stream 0 and each row's own seed: what the request draws alone
        return gumbel_argmax(scaled, self.vocab_hash, torch.zeros_like(rows), positions, self.row_seed[:, 0],
                             self.row_seed[:, 1], self.use_kernels)

    def filter(self, logits: torch.Tensor, use_top_k: bool = True, use_top_p: bool = True) -> torch.Tensor:
        """Each row's temperature, and its top-k and top-p where its flags say; `use_top_k` / `use_top_p` False
        skip a filter no row uses (the result is the same: every row's flag is off), and with both off the
        vocabulary is not sorted."""
        scaled = logits / self.temperature
        if not (use_top_k or use_top_p):
            return scaled
        ordered, order = scaled.sort(dim=-1, descending=True)
        if use_top_k:
            kth = ordered.gather(-1, (self.top_k - 1).clamp(min=0))
            scaled = scaled.masked_fill(self.use_top_k & (scaled < kth), float("-inf"))
            ordered = ordered.masked_fill(self.use_top_k & (ordered < kth), float("-inf"))
        if not use_top_p:
            return scaled
        probs = ordered.softmax(-1)
        before = probs.cumsum(-1) - probs
        drop_sorted = self.use_top_p & (before >= self.top_p)
        drop_sorted[:, 0] = False  # the likeliest token always stays (a top_p below fp32's range reads 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        return scaled.masked_fill(drop, float("-inf"))

    def __call__(self, logits: torch.Tensor, params: SamplingParams, rows: torch.Tensor,
                 positions: torch.Tensor, adjust: bool | None = None) -> torch.Tensor:
        """logits [B, V] -> token ids [B]. Every row has its own values (`set_row`); `params` says which paths some
        row may take (a step's shape: greedy when no row samples; top-k, top-p when a row filters), and bias and
        penalties unless `adjust` says."""
        if params.adjusts if adjust is None else adjust:
            logits = self.adjust(logits)
        if params.greedy:
            return logits.argmax(dim=-1)
        scaled = self.filter(logits.float(), 0 < params.top_k < self.vocab, params.top_p < 1.0)
        return torch.where(self.greedy, logits.argmax(dim=-1), self.draw(scaled, rows, positions))


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [V] fp32 -> temperature-scaled logits with tokens outside top-k / top-p set to -inf."""
    sampler = DeviceSampler(logits.shape[-1], logits.device)
    sampler.set_params(params)
    return sampler.filter(logits.float()[None], 0 < params.top_k < logits.shape[-1], params.top_p < 1.0)[0]


def sample(logits: torch.Tensor, params: SamplingParams, rows: list[int], positions: list[int]) -> torch.Tensor:
    """logits [B, V] -> token ids [B] (int64, on logits' device). `rows`/`positions` seed each row's noise; bias and
    penalties apply as to a first token (nothing generated yet)."""
    sampler = DeviceSampler(logits.shape[-1], logits.device, logits.shape[0])
    sampler.set_params(params)
    dev = logits.device
    return sampler(logits, params, torch.tensor(rows, device=dev), torch.tensor(positions, device=dev))


def row_paths(params: list[SamplingParams], vocab: int) -> SamplingParams:
    """The sampling paths a step of these rows needs, as the flags a step shape reads (`decode.StepShape`): greedy
    when no row samples, top-k / top-p when a row filters so, bias and penalties and log-probabilities when a row asks.
    Rows keep their own values (`RowSampler.set_row`); a path no row takes changes no row's token."""
    sampled = [p for p in params if not p.greedy]
    return SamplingParams(temperature=1.0 if sampled else 0.0,
                          top_k=1 if any(0 < p.top_k < vocab for p in sampled) else 0,
                          top_p=0.5 if any(p.top_p < 1.0 for p in sampled) else 1.0,
                          presence_penalty=1.0 if any(p.adjusts for p in params) else 0.0,
                          logprobs=0 if any(p.logprobs is not None for p in params) else None)
