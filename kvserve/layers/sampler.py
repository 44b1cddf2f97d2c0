"""Turn one step's logits into next tokens (and the logprobs a request asked for), on the logits' device.

Order of operations, per row (vLLM/OpenAI meanings; see `SamplingParams`):

0. **Grammar** (structured output, ``SamplingRow.grammar_mask``): every token the request's grammar does not
   allow next is set to -inf in the logits (in place), before everything below: the logprobs too are the
   constrained distribution's, as vLLM's.
1. **Logprobs** (only when some row has ``params.logprobs`` set) come from the *raw* logits:
   ``log_softmax`` in float32, before anything below.
2. **logit_bias** added (before the penalties, as vLLM v1's sampler and HF Transformers' processors order
   them). Token ids outside the vocabulary are ignored here: the input processor rejects them; a bad id must
   not crash a whole batch.
3. **Penalties** on the biased logits: ``repetition_penalty`` for every token seen in the prompt or the
   output (positive logits divided, negative multiplied), then ``frequency_penalty * count`` and
   ``presence_penalty * [count > 0]`` subtracted, counting output tokens only. Rows that carry their
   request's id keep these counts on the device across steps (`PenaltyCounts`): the prompt is marked once
   and only the output tokens new since the last step are uploaded and counted. Under async scheduling a
   row's newest token may not have reached the host yet (``SamplingRow.pending_row``): it is counted from
   the previous step's sampled ids on the device, here and in min_tokens' count. Then **bad_words**: a
   word's last token is set to -inf where the output so far ends with the word's other tokens (a pending
   newest token is compared on the device).
4. **min_tokens**: while ``len(output) < min_tokens`` the request's ``stop_token_ids`` and, unless
   ``ignore_eos``, the EOS ids (the model's and the row's own) are set to -inf (as in vLLM: with
   ``ignore_eos`` EOS is an ordinary token that cannot end the request, so there is nothing to hold back).
5. **Greedy** rows (``temperature ~ 0``): argmax of the logits after 2-4. Top-k/top-p/min-p do not apply.
6. Other rows: divide by ``temperature``; **min-p** (drop tokens with ``p < min_p * p_max``); **top-k**
   (keep logits >= the k-th largest, so ties at the boundary are kept); **top-p** (nucleus over the sorted
   renormalised probabilities of what min-p and top-k kept: a token is kept while the probability mass
   *before* it is < top_p, so the top token always stays), in vLLM v1's order; then sample with the
   exponential race ``argmax(p / q)``, ``q ~ Exp(1)``.
   A row with its own generator (``params.seed``) draws ``q`` from it, a full-vocabulary draw per step, so
   its token depends only on its logits and its generator: not on the batch size, its position, or the
   other rows. Unseeded rows draw from the sampler's shared generator.

Output layout: every row gets a logprobs row (width ``1 + max_k`` over the batch); rows that did not ask
or asked for fewer than ``max_k`` are sliced by the caller (``[:1 + k]``).

Host syncs: none. Per-row parameters travel host→device from pinned memory with ``non_blocking`` copies;
the only device→host copy of the step belongs to the caller (sampled ids and logprobs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.kernels import ops
from kvserve.protocol.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One request's row in this step's batch (row i of the logits)."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far, before this step
    generator: torch.Generator | None  # the request's own generator when params.seed is set, else None
    # The request's id: its penalty counts are kept across steps under it (`PenaltyCounts`), and the caller
    # releases them (`Sampler.release`) when the request ends. None: counted from the lists at every call.
    req_id: str | None = None
    # Async scheduling: the request's newest token, sampled by the previous step, is not in
    # output_token_ids yet; it is row `pending_row` of the previous step's sampled ids on the device (the
    # `pending_ids` the sampler is called with). Penalties count it and min_tokens counts it from there, so
    # such requests need not wait for the host to read each step's tokens.
    pending_row: int | None = None
    # Structured output: the tokens the request's grammar allows next (int32 words, one bit per token id,
    # `kvserve.structured_output`); None: no grammar constrains this step.
    grammar_mask: bytes | None = None
    # EOS ids of the request's own besides the model's (the sampler call's): its tokenizer's EOS, which ends
    # the request as well, so min_tokens holds it back too.
    eos_token_ids: Sequence[int] = ()


@dataclass
class SamplerOutput:
    """Device tensors; all ``None`` logprob fields when no row asked for logprobs.

    * ``sampled_token_ids``: int64 ``[num_rows]``.
    * ``logprobs``: float32 ``[num_rows, 1 + max_k]``: column 0 is the sampled token's raw logprob, columns
      ``1..`` the top-``max_k`` raw logprobs in descending order.
    * ``logprob_token_ids``: int64 ``[num_rows, 1 + max_k]``: the matching token ids.
    * ``sampled_ranks``: int64 ``[num_rows]``: 1 + the number of tokens with a strictly larger raw logprob
      than the sampled one (1 = the top token).
    """

    sampled_token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    logprob_token_ids: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator on `device` seeded with `seed` (one per seeded request, kept across its steps)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device` without a host sync.

    A plain ``.to(cuda)`` from pageable memory waits for the stream (the whole forward pass); from pinned
    memory with ``non_blocking`` it is queued instead. The caching host allocator keeps the pinned buffer
    alive until the copy has run.
    """
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return tensor
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


# ---------------------------------------------------------------------------------------------------------
# The pieces, each a pure function on tensors (tests check them against hand computations).
# ---------------------------------------------------------------------------------------------------------


def apply_grammar_masks_(logits: torch.Tensor, row_index: Sequence[int], masks: Sequence[bytes]) -> None:
    """-inf, in place, at every token a row's grammar mask does not allow (rows `row_index`, masks in the same
    order: int32 words, token t is bit t % 32 of word t // 32, little-endian; ids past a mask's bits are not
    allowed). Copied to the device without a host sync; the temporaries are the masked rows' (a byte per
    token for the unpacked bits), not the whole batch's."""
    device = logits.device
    num_rows, vocab_size = len(row_index), logits.shape[1]
    # Little-endian int32 words as bytes: token t is bit t % 8 of byte t // 8.
    packed = torch.frombuffer(bytearray(b"".join(masks)), dtype=torch.uint8).view(num_rows, -1)
    if device.type == "cuda":
        packed = packed.pin_memory()
    packed = packed.to(device, non_blocking=True)
    shifts = torch.arange(8, dtype=torch.uint8, device=device)
    bits = ((packed.unsqueeze(2) >> shifts) & 1).view(num_rows, -1)
    width = min(bits.shape[1], vocab_size)
    refused = torch.ones((num_rows, vocab_size), dtype=torch.bool, device=device)
    refused[:, :width] = bits[:, :width] == 0
    del bits
    index = to_device(list(row_index), torch.int64, device)
    logits[index] = logits[index].masked_fill(refused, float("-inf"))


def token_counts(
    token_id_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """How often each token occurs in each list: float32 ``[len(token_id_lists), vocab_size]``.

    Ids outside ``[0, vocab_size)`` are not counted.
    """
    num_rows = len(token_id_lists)
    max_len = max((len(ids) for ids in token_id_lists), default=0)
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=device)
    if max_len == 0:
        return counts[:, :vocab_size]
    # Pad (and redirect out-of-range ids) to the extra column `vocab_size`, dropped below.
    padded = [
        [t if 0 <= t < vocab_size else vocab_size for t in ids] + [vocab_size] * (max_len - len(ids))
        for ids in token_id_lists
    ]
    index = to_device(padded, torch.int64, device)
    counts.scatter_add_(1, index, torch.ones(index.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab_size]


def add_pending_tokens(
    counts: torch.Tensor, count_rows: list[int], pending_rows: list[int], pending_ids: torch.Tensor | None
) -> None:
    """counts[count_rows[j], pending_ids[pending_rows[j]]] += 1 for each j, on the device (the tokens are
    never read on the host)."""
    if pending_ids is None:
        raise ValueError("rows have a pending_row but no pending_ids were given")
    device = counts.device
    tokens = pending_ids.index_select(0, to_device(pending_rows, torch.int64, pending_ids.device)).to(device)
    counts.index_put_(
        (to_device(count_rows, torch.int64, device), tokens),
        torch.ones(len(count_rows), dtype=counts.dtype, device=device),
        accumulate=True,
    )


class PenaltyCounts:
    """The penalties' token counts of live requests, on one device, kept from step to step.

    Each request holds a slot: a row of ``seen`` (its prompt's tokens, marked once, when its repetition
    penalty is on) and of ``counts`` (how often each token occurs in its output), of two ``[capacity,
    vocab]`` buffers that grow, at least doubling, when arrivals need more slots (the engine's memory profile
    sizes them for max_num_seqs rows at start; they are not shrunk). A step uploads only the output tokens a request produced since
    its last step (usually one), so its host work does not grow with the prompt or output length. Output
    token lists are append-only while a request lives; one shorter than what was counted (not expected)
    is counted again from the start. `release` frees the slots of requests that ended.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)
        self._slot: dict[str, int] = {}
        self._counted: dict[str, int] = {}  # output tokens counted, per request
        self._prompt_marked: set[str] = set()
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self._slot)

    @property
    def nbytes(self) -> int:
        """Device memory the two buffers hold."""
        return self.seen.numel() * self.seen.element_size() + self.counts.numel() * self.counts.element_size()

    def update(self, rows: Sequence[SamplingRow], pending_ids: torch.Tensor | None = None) -> list[int]:
        """Count what is new for these rows (each with a req_id) and return their slots, in row order: the
        tokens of `output_token_ids` not counted yet, and a row's `pending_row` token, read from
        `pending_ids` on the device (it is counted as the list's next token, which it becomes once the host
        reads it). A row whose repetition penalty is off gets no prompt marks."""
        cleared: list[int] = []
        slots: list[int] = []
        marks: tuple[list[int], list[int]] = ([], [])
        adds: tuple[list[int], list[int]] = ([], [])
        pending: tuple[list[int], list[int]] = ([], [])  # (slot, row of pending_ids)
        arriving = sum(row.req_id not in self._slot for row in rows)
        if arriving > len(self._free):  # grown once for the whole batch (at least doubled)
            self._grow(max(len(self._slot) + arriving, 2 * self.counts.shape[0], 8))
        for row in rows:
            req_id = row.req_id
            assert req_id is not None, "PenaltyCounts needs the rows' request ids"
            output = row.output_token_ids
            slot = self._slot.get(req_id)
            if slot is None or len(output) < self._counted[req_id]:
                if slot is None:
                    slot = self._slot[req_id] = self._free.pop()  # there are enough: grown above
                cleared.append(slot)
                self._counted[req_id] = 0
                self._prompt_marked.discard(req_id)
            if row.params.repetition_penalty != 1.0 and req_id not in self._prompt_marked:
                ids = [t for t in row.prompt_token_ids if 0 <= t < self.vocab_size]
                marks[0].extend([slot] * len(ids))
                marks[1].extend(ids)
                self._prompt_marked.add(req_id)
            new = [t for t in output[self._counted[req_id]:] if 0 <= t < self.vocab_size]
            adds[0].extend([slot] * len(new))
            adds[1].extend(new)
            self._counted[req_id] = len(output)
            if row.pending_row is not None:
                pending[0].append(slot)
                pending[1].append(row.pending_row)
                self._counted[req_id] += 1
            slots.append(slot)
        # Fills and values made on the device: a Python scalar as an index_put_ value would be a synchronous copy.
        if cleared:
            index = to_device(cleared, torch.int64, self.device)
            self.seen.index_fill_(0, index, False)
            self.counts.index_fill_(0, index, 0.0)
        if marks[1]:
            self.seen.index_put_(
                (to_device(marks[0], torch.int64, self.device), to_device(marks[1], torch.int64, self.device)),
                torch.ones(len(marks[1]), dtype=torch.bool, device=self.device),
            )
        if adds[1]:
            self.counts.index_put_(
                (to_device(adds[0], torch.int64, self.device), to_device(adds[1], torch.int64, self.device)),
                torch.ones(len(adds[1]), dtype=torch.float32, device=self.device),
                accumulate=True,
            )
        if pending[0]:
            add_pending_tokens(self.counts, pending[0], pending[1], pending_ids)
        return slots

    def release(self, req_ids: Sequence[str]) -> None:
        """Free the slots of these requests (unknown ids are ignored)."""
        for req_id in req_ids:
            slot = self._slot.pop(req_id, None)
            if slot is not None:
                self._free.append(slot)
                del self._counted[req_id]
                self._prompt_marked.discard(req_id)

    def check_invariants(self, live_req_ids: set[str] | None = None) -> None:
        """Each slot belongs to one request or is free, never both; the buffers cover every slot; with
        `live_req_ids`, only live requests hold slots."""
        held = list(self._slot.values())
        assert len(set(held)) == len(held), "two requests share a penalty slot"
        assert not set(held) & set(self._free), "a held penalty slot is also free"
        assert len(set(self._free)) == len(self._free), "a penalty slot is free twice"
        assert sorted(held + self._free) == list(range(self.counts.shape[0])), "penalty slots lost or unknown"
        assert self.seen.shape == self.counts.shape, "penalty buffers differ in shape"
        assert set(self._counted) == set(self._slot) and self._prompt_marked <= set(self._slot)
        if live_req_ids is not None:
            assert set(self._slot) <= live_req_ids, "a finished request still holds a penalty slot"

    def _grow(self, capacity: int) -> None:
        old = self.counts.shape[0]
        if capacity <= old:
            return
        seen = torch.zeros(capacity, self.vocab_size, dtype=torch.bool, device=self.device)
        counts = torch.zeros(capacity, self.vocab_size, dtype=torch.float32, device=self.device)
        seen[:old] = self.seen
        counts[:old] = self.counts
        self.seen, self.counts = seen, counts
        self._free.extend(range(capacity - 1, old - 1, -1))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Copy of `logits` (float32 ``[R, V]``) with tokens outside top-k and then top-p set to -inf.

    `top_k`: int64 ``[R]``, 0 (or >= V) = off; `top_p`: float32 ``[R]``, 1 = off. Top-k keeps every logit
    >= the k-th largest. Top-p then sorts the surviving probabilities and keeps a token while the mass
    of the tokens ranked above it is < top_p (the top token always survives).
    """
    vocab_size = logits.shape[1]
    sorted_logits, sorted_ids = logits.sort(dim=1, descending=True)
    k = torch.where((top_k <= 0) | (top_k > vocab_size), torch.full_like(top_k, vocab_size), top_k)
    kth_logit = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_logit, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=1)
    mass_before = sorted_probs.cumsum(dim=1) - sorted_probs
    # `top_p < 1` guard: rounding in the cumsum must not drop tail tokens of a row with top-p off.
    drop_sorted = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    drop_sorted |= sorted_logits == float("-inf")
    drop = torch.zeros_like(drop_sorted).scatter_(1, sorted_ids, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Copy of `logits` (float32 ``[R, V]``) with tokens of ``p < min_p * p_max`` set to -inf.

    `min_p`: float32 ``[R]``, 0 = off. The ratio p / p_max does not depend on renormalisation, so it is the
    same before or after top-k; top-p after it reads the distribution it leaves.
    """
    probs = logits.softmax(dim=1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_min_p_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Min-p, then top-k, then top-p (vLLM v1's order; see the two functions); shapes as there."""
    return apply_top_k_top_p(apply_min_p(logits, min_p), top_k, top_p)


def exponential_race(
    probs: torch.Tensor,
    row_generators: Sequence[torch.Generator | None],
    shared_generator: torch.Generator | None,
) -> torch.Tensor:
    """Sample one token per row of `probs` (float32 ``[R, V]``, rows sum to 1): int64 ``[R]``.

    ``argmax(p / q)`` with ``q ~ Exp(1)`` i.i.d. picks token i with probability p_i (``q_i / p_i`` is
    Exp(p_i) and the smallest of independent exponentials is i with probability p_i / sum p). Row i draws
    its noise from ``row_generators[i]`` when given, else from `shared_generator` (None: torch's default).
    """
    noise = torch.empty_like(probs)
    if any(g is None for g in row_generators):
        noise.exponential_(generator=shared_generator)
    for row, generator in enumerate(row_generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    # Exp(1) can round to 0; 0/0 would be NaN, which argmax treats as the maximum.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=1)


def compute_logprobs(
    raw_logprobs: torch.Tensor, sampled_token_ids: torch.Tensor, max_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprobs ``[R, 1 + max_k]``, token ids ``[R, 1 + max_k]``, sampled ranks ``[R]``); see `SamplerOutput`."""
    sampled = sampled_token_ids.unsqueeze(1)
    sampled_logprob = raw_logprobs.gather(1, sampled)
    ranks = (raw_logprobs > sampled_logprob).sum(dim=1) + 1
    if max_k > 0:
        top_logprobs, top_ids = raw_logprobs.topk(max_k, dim=1)
        logprobs = torch.cat([sampled_logprob, top_logprobs], dim=1)
        ids = torch.cat([sampled, top_ids], dim=1)
    else:
        logprobs, ids = sampled_logprob, sampled
    return logprobs, ids, ranks


# ---------------------------------------------------------------------------------------------------------


def _is_plain_greedy(params: SamplingParams) -> bool:
    return (params.is_greedy and not params.needs_output_history and not params.logit_bias
            and params.allowed_token_ids is None)


class Sampler:
    """Applies the steps in the module docstring to a batch; one instance per model runner."""

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        # One shared generator per device, made on first use (the device is only known at call time).
        self._shared_generators: dict[torch.device, torch.Generator] = {}
        self.penalty_counts: PenaltyCounts | None = None  # made on the first penalised row with a req_id

    def release(self, req_ids: Sequence[str]) -> None:
        """Forget the kept state (penalty counts) of requests that ended."""
        if self.penalty_counts is not None:
            self.penalty_counts.release(req_ids)

    def kept_bytes(self) -> int:
        """Device memory of the state kept across steps (the penalty counts' buffers)."""
        return self.penalty_counts.nbytes if self.penalty_counts is not None else 0

    def check_invariants(self, live_req_ids: set[str] | None = None) -> None:
        if self.penalty_counts is not None:
            self.penalty_counts.check_invariants(live_req_ids)

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        eos_token_ids: Sequence[int],
        pending_ids: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """`logits`: float ``[len(rows), vocab]`` (not modified, except for the rows a grammar masks: those
        are masked in place). `pending_ids`: the previous step's sampled ids on the logits' device, which rows
        with a `pending_row` index. Returns tensors on the logits' device."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [num_rows={len(rows)}, vocab], got {tuple(logits.shape)}")
        constrained = [i for i, row in enumerate(rows) if row.grammar_mask is not None]
        if constrained:  # before everything, the raw logprobs included (as vLLM's)
            apply_grammar_masks_(logits, constrained, [rows[i].grammar_mask for i in constrained])
        asked = [row.params.logprobs for row in rows if row.params.logprobs is not None]
        if not asked and all(_is_plain_greedy(row.params) for row in rows):
            # Nothing changes the logits: argmax of them as they are (exact, no float32 copy of the batch).
            return SamplerOutput(sampled_token_ids=logits.argmax(dim=1))
        raw_logprobs = torch.log_softmax(logits.float(), dim=1) if asked else None

        # Our own float32 copy: the caller's tensor stays untouched.
        work = logits.to(dtype=torch.float32, copy=True)
        work = self._apply_logit_bias(work, rows)
        work = self._apply_penalties(work, rows, pending_ids)
        work = self._apply_bad_words(work, rows, pending_ids)
        work = self._apply_allowed_tokens(work, rows)
        work = self._apply_min_tokens(work, rows, eos_token_ids)
        sampled = self._sample(work, rows)

        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        logprobs, logprob_ids, ranks = compute_logprobs(raw_logprobs, sampled, max(asked))
        return SamplerOutput(sampled, logprobs, logprob_ids, ranks)

    # -- steps --------------------------------------------------------------------------------------------

    def _apply_penalties(
        self, work: torch.Tensor, rows: Sequence[SamplingRow], pending_ids: torch.Tensor | None
    ) -> torch.Tensor:
        index = [
            i
            for i, row in enumerate(rows)
            if row.params.repetition_penalty != 1.0
            or row.params.frequency_penalty != 0.0
            or row.params.presence_penalty != 0.0
        ]
        if not index:
            return work
        device, vocab_size = work.device, work.shape[1]
        if all(rows[i].req_id is not None for i in index):
            kept = self.penalty_counts
            if kept is None or kept.device != device or kept.vocab_size != vocab_size:
                kept = self.penalty_counts = PenaltyCounts(vocab_size, device)
            slots = kept.update([rows[i] for i in index], pending_ids)
            seen, counts = kept.seen, kept.counts
        else:
            # Prompt tokens only matter for the repetition penalty: skip counting them when it is off.
            prompts = [
                rows[i].prompt_token_ids if rows[i].params.repetition_penalty != 1.0 else () for i in index
            ]
            seen = token_counts(prompts, vocab_size, device) > 0
            counts = token_counts([rows[i].output_token_ids for i in index], vocab_size, device)
            pending = [(j, rows[i].pending_row) for j, i in enumerate(index) if rows[i].pending_row is not None]
            if pending:
                add_pending_tokens(counts, [j for j, _ in pending], [r for _, r in pending], pending_ids)
            slots = list(range(len(index)))
        params = [rows[i].params for i in index]
        ops.penalise_rows_(
            work,
            to_device(index, torch.int64, device),
            to_device(slots, torch.int64, device),
            seen,
            counts,
            to_device([p.repetition_penalty for p in params], torch.float32, device),
            to_device([p.frequency_penalty for p in params], torch.float32, device),
            to_device([p.presence_penalty for p in params], torch.float32, device),
        )
        return work

    @staticmethod
    def _apply_logit_bias(work: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        vocab_size = work.shape[1]
        row_ids: list[int] = []
        token_ids: list[int] = []
        values: list[float] = []
        for i, row in enumerate(rows):
            for token_id, value in (row.params.logit_bias or {}).items():
                if 0 <= token_id < vocab_size:
                    row_ids.append(i)
                    token_ids.append(token_id)
                    values.append(value)
        if not row_ids:
            return work
        device = work.device
        work.index_put_(
            (to_device(row_ids, torch.int64, device), to_device(token_ids, torch.int64, device)),
            to_device(values, torch.float32, device),
            accumulate=True,
        )
        return work

    @staticmethod
    def _apply_bad_words(
        work: torch.Tensor, rows: Sequence[SamplingRow], pending_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """-inf for a bad word's last token where the output so far ends with the word's other tokens. A row
        whose newest token is still on the device (`pending_row`) has the bans that need that token as the
        word's next-to-last compared there."""
        vocab_size = work.shape[1]
        banned: tuple[list[int], list[int]] = ([], [])  # (row, token)
        maybe: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])  # + (pending row, token)
        for i, row in enumerate(rows):
            words = row.params.bad_words_token_ids
            if not words:
                continue
            history = row.output_token_ids
            known = len(history)
            pending = row.pending_row
            for ids in words:
                last = ids[-1]
                if last >= vocab_size:
                    continue
                if pending is None:
                    before = len(ids) - 1  # tokens that must end the output
                    if before <= known and list(history[known - before:]) == ids[:-1]:
                        banned[0].append(i)
                        banned[1].append(last)
                elif len(ids) == 1:
                    banned[0].append(i)
                    banned[1].append(last)
                else:
                    before = len(ids) - 2  # known tokens before the pending one
                    if before <= known and list(history[known - before:]) == ids[:-2]:
                        for part, value in zip(maybe, (i, last, pending, ids[-2]), strict=True):
                            part.append(value)
        device = work.device
        if banned[0]:
            work.index_put_(
                (to_device(banned[0], torch.int64, device), to_device(banned[1], torch.int64, device)),
                torch.full((len(banned[0]),), float("-inf"), device=device),
            )
        if maybe[0]:
            if pending_ids is None:
                raise ValueError("rows have a pending_row but no pending_ids were given")
            rows_t = to_device(maybe[2], torch.int64, pending_ids.device)
            hit = pending_ids.index_select(0, rows_t).to(device) == to_device(maybe[3], torch.int64, device)
            # Added, not written: two conditions on one (row, token) must not overwrite each other.
            work.index_put_(
                (to_device(maybe[0], torch.int64, device), to_device(maybe[1], torch.int64, device)),
                torch.where(hit, float("-inf"), 0.0),
                accumulate=True,
            )
        return work

    @staticmethod
    def _apply_allowed_tokens(work: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """-inf for every token outside a row's allowed_token_ids."""
        vocab_size = work.shape[1]
        index = [i for i, row in enumerate(rows) if row.params.allowed_token_ids is not None]
        if not index:
            return work
        device = work.device
        mask_rows: list[int] = []
        mask_ids: list[int] = []
        for j, i in enumerate(index):
            ids = [t for t in rows[i].params.allowed_token_ids or () if t < vocab_size]
            mask_rows.extend([j] * len(ids))
            mask_ids.extend(ids)
        allowed = torch.zeros((len(index), vocab_size), dtype=torch.bool, device=device)
        allowed[to_device(mask_rows, torch.int64, device), to_device(mask_ids, torch.int64, device)] = True
        rows_t = to_device(index, torch.int64, device)
        work[rows_t] = work[rows_t].masked_fill(~allowed, float("-inf"))
        return work

    @staticmethod
    def _apply_min_tokens(
        work: torch.Tensor, rows: Sequence[SamplingRow], eos_token_ids: Sequence[int]
    ) -> torch.Tensor:
        vocab_size = work.shape[1]
        row_ids: list[int] = []
        token_ids: list[int] = []
        for i, row in enumerate(rows):
            params = row.params
            if len(row.output_token_ids) + (row.pending_row is not None) >= params.min_tokens:
                continue
            banned = set(params.stop_token_ids or ())
            if not params.ignore_eos:
                banned.update(eos_token_ids)
                banned.update(row.eos_token_ids)
            for token_id in banned:
                if 0 <= token_id < vocab_size:
                    row_ids.append(i)
                    token_ids.append(token_id)
        if not row_ids:
            return work
        device = work.device
        index = (to_device(row_ids, torch.int64, device), to_device(token_ids, torch.int64, device))
        # A device-side fill: a Python scalar turned into a device tensor would be a synchronous copy.
        work.index_put_(index, torch.full((len(row_ids),), float("-inf"), device=device))
        return work

    def _sample(self, work: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        greedy = [row.params.is_greedy for row in rows]
        if all(greedy):
            return work.argmax(dim=1)
        device = work.device
        # Greedy rows ride along with neutral settings; their result is replaced by the argmax below.
        temperature, top_k, top_p, min_p = [], [], [], []
        for row, is_greedy in zip(rows, greedy, strict=True):
            p = row.params
            temperature.append(1.0 if is_greedy else p.temperature)
            top_k.append(0 if is_greedy else p.top_k)
            top_p.append(1.0 if is_greedy else p.top_p)
            min_p.append(0.0 if is_greedy else p.min_p)
        scaled = work / to_device(temperature, torch.float32, device).unsqueeze(1)
        if any(p > 0.0 for p in min_p):  # first, as vLLM v1: top-p then reads what min-p left
            scaled = apply_min_p(scaled, to_device(min_p, torch.float32, device))
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            scaled = apply_top_k_top_p(
                scaled, to_device(top_k, torch.int64, device), to_device(top_p, torch.float32, device)
            )
        probs = scaled.softmax(dim=1)
        # Greedy rows draw nothing from their own generator: its stream advances only on sampled steps.
        generators = [None if g else row.generator for row, g in zip(rows, greedy, strict=True)]
        sampled = exponential_race(probs, generators, self._shared_generator(device))
        if any(greedy):
            sampled = torch.where(to_device(greedy, torch.bool, device), work.argmax(dim=1), sampled)
        return sampled

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        generator = self._shared_generators.get(device)
        if generator is None:
            generator = make_generator(self._seed, device)
            self._shared_generators[device] = generator
        return generator
