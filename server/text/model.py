"""The embedded text model: a small decoder-only transformer in torch with a slot-based KV cache.

A load-test model, as vLLM's ``--load-format dummy`` is: the architecture of a real decoder
(pre-norm blocks, causal multi-head attention, GELU MLP, learned positions) with deterministic
weights drawn from a seeded generator, so that every replica computes the same tokens and a
fingerprint names them. Outputs are not meaningful text; costs and behaviour under load are.

The KV cache holds ``max_slots`` sequences of up to ``context`` tokens. :meth:`TinyLM.prefill`
runs one sequence's prompt and fills its slot; :meth:`TinyLM.decode` advances any set of slots
by one token in one forward pass (that is what lets sequences join and leave the running batch
between steps). :meth:`TinyLM.prefill_sample` and :meth:`TinyLM.decode_sample` do the same and
also pick the next tokens inside the same graph (the engine's path: the logits never leave
torch). This module imports torch at import time: import it lazily (the engine does).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from chunkline.client.wire.fingerprint import weights_digest
from chunkline.server.text.sampling import SamplingParams
from chunkline.server.text.tokenizer import SPECIAL_TOKENS, STOP_TOKENS, VOCAB_SIZE

__all__ = ["TinyLMConfig", "dummy_weights", "TinyLM"]


@dataclasses.dataclass(frozen=True)
class TinyLMConfig:
    """Architecture of the embedded model.

    Args:
        vocab_size: embedding rows (bytes + special tokens).
        d_model: width.
        n_layers: transformer blocks.
        n_heads: attention heads (``d_model`` must divide evenly).
        d_ff: MLP hidden width.
        context: longest sequence (prompt + output) in tokens.
        seed: seed of the dummy weights.
        logit_scale: scale of the output projection; larger gives peakier next-token distributions.
    """

    vocab_size: int = VOCAB_SIZE
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 512
    context: int = 512
    seed: int = 0
    logit_scale: float = 4.0

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError("d_model must be a multiple of n_heads")
        if min(self.vocab_size, self.d_model, self.n_layers, self.n_heads, self.d_ff, self.context) < 1:
            raise ValueError("every size must be positive")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def dummy_weights(cfg: TinyLMConfig) -> dict[str, np.ndarray]:
    """Deterministic float32 weights for ``cfg`` (same seed, same arrays, on every machine).

    Args:
        cfg: the architecture (its ``seed`` picks the weights).
    """
    rng = np.random.Generator(np.random.PCG64(cfg.seed))
    d, f, v, c = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.context
    depth = 1.0 / math.sqrt(2.0 * cfg.n_layers)  # residual branches scaled as in GPT-2

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    w: dict[str, np.ndarray] = {
        "tok_emb": normal((v, d), 1.0),
        "pos_emb": normal((c, d), 0.1),
        "ln_f.g": np.ones(d, np.float32),
        "ln_f.b": np.zeros(d, np.float32),
        "unembed": normal((v, d), cfg.logit_scale / math.sqrt(d)),
        "unembed.b": np.zeros(v, np.float32),
    }
    # Favour printable ASCII and newlines, so that the dummy output reads as (random) text
    # rather than mostly invalid UTF-8.
    w["unembed.b"][32:127] = 2.5
    w["unembed.b"][10] = 2.5
    for i in range(cfg.n_layers):
        p = f"layer{i}."
        w[p + "ln1.g"] = np.ones(d, np.float32)
        w[p + "ln1.b"] = np.zeros(d, np.float32)
        w[p + "qkv.w"] = normal((3 * d, d), 1.0 / math.sqrt(d))
        w[p + "qkv.b"] = np.zeros(3 * d, np.float32)
        w[p + "out.w"] = normal((d, d), depth / math.sqrt(d))
        w[p + "out.b"] = np.zeros(d, np.float32)
        w[p + "ln2.g"] = np.ones(d, np.float32)
        w[p + "ln2.b"] = np.zeros(d, np.float32)
        w[p + "fc1.w"] = normal((f, d), 1.0 / math.sqrt(d))
        w[p + "fc1.b"] = np.zeros(f, np.float32)
        w[p + "fc2.w"] = normal((d, f), depth / math.sqrt(f))
        w[p + "fc2.b"] = np.zeros(d, np.float32)
    return w


class TinyLM:
    """The model and its KV cache (one thread uses it at a time: the engine's).

    The cache is preallocated: keys and values of every layer in blocks of :attr:`ATTN_BLOCK`
    positions, block-major (block ``j`` of every slot is one contiguous run of memory), so joining
    and leaving never allocate or copy, and a decode step streams the blocks it reads. A step is
    one TorchScript call: one release of the GIL, no Python between its operations.

    Decode attention runs over the cache block by block, all rows at once, with a length mask:
    each block is one batched product of fixed shape, and the blocks are combined with the
    maximum over all of a row's blocks as the softmax shift. Blocks past a row's own length are
    fully masked and add exact zeros, so a row's result does not depend on how many blocks the
    longest row in the batch needed. A model with one slot has no batch to be invariant against:
    its single row attends over exactly its own keys in one call.

    Batch invariance: with ``fixed_shape`` (the default) every decode step runs every operation
    on all ``max_slots`` rows, whichever sequences are active. CPU kernels pick their blocking
    and reduction order from the tensor shapes (a ``[1, d]`` and a ``[16, d]`` matrix product
    round differently), so only shapes that never depend on the other sequences make a
    sequence's logits bit-for-bit the same alone or in any batch, and with them its seeded
    samples. It costs a full batch's matrix products at low occupancy; ``False`` trades that for
    shapes that follow the active rows (tokens then agree with high probability, not always).

    Args:
        cfg: the architecture.
        max_slots: sequences the KV cache holds at once (the engine's ``max_batch``).
        weights: the parameters (default :func:`dummy_weights`).
        device: torch device.
        fixed_shape: see above.
    """

    #: Attention block length in cache positions (a multiple of 16, so that no row of a block
    #: ever falls into a kernel's scalar tail).
    ATTN_BLOCK = 64
    #: Names this implementation's arithmetic (part of the served model's fingerprint: a change
    #: that moves any rounding changes the tokens a seed gives).
    NUMERICS = "tinylm-v2:gelu-erf,attention-blocks-64,single-slot-exact-span,torch-sampling-f64"

    def __init__(
        self,
        cfg: TinyLMConfig,
        max_slots: int,
        weights: dict[str, np.ndarray] | None = None,
        device: str = "cpu",
        fixed_shape: bool = True,
    ) -> None:
        if max_slots < 1:
            raise ValueError("max_slots must be >= 1")
        self.cfg = cfg
        self.max_slots = max_slots
        self.device = dev = torch.device(device)
        arrays = weights if weights is not None else dummy_weights(cfg)
        self.weights_digest = weights_digest(arrays)
        self._w = {k: torch.from_numpy(np.ascontiguousarray(a)).to(dev) for k, a in arrays.items()}
        w = self._w
        # Lists rather than a dict keyed by name: the graphs index them instead of building
        # strings and hashing them at every operation.
        self._glob = [w["tok_emb"], w["pos_emb"], w["ln_f.g"], w["ln_f.b"], w["unembed"], w["unembed.b"]]
        self._layers = [[w[f"layer{i}.{n}"] for n in _LAYER_PARAMS] for i in range(cfg.n_layers)]
        # Block-major: [layers, blocks, slots, heads, ATTN_BLOCK, head_dim].
        blocks = -(-cfg.context // self.ATTN_BLOCK)
        shape = (cfg.n_layers, blocks, max_slots, cfg.n_heads, self.ATTN_BLOCK, cfg.head_dim)
        self._k = torch.zeros(shape, dtype=torch.float32, device=dev)
        self._v = torch.zeros(shape, dtype=torch.float32, device=dev)
        self.fixed_shape = fixed_shape
        self._no_rows = torch.zeros(0, dtype=torch.long, device=dev)
        vocab = cfg.vocab_size
        self._never = torch.tensor(sorted(t for t in SPECIAL_TOKENS - STOP_TOKENS if t < vocab), dtype=torch.long, device=dev)
        self._stops = torch.tensor(sorted(t for t in STOP_TOKENS if t < vocab), dtype=torch.long, device=dev)
        self._no_sampling = _SamplingRows.empty(0).tensors(dev)

    @property
    def context(self) -> int:
        """Longest sequence in tokens."""
        return self.cfg.context

    # ------------------------------------------------------------------ forward passes

    @torch.inference_mode()
    def prefill(self, slot: int, tokens: Sequence[int]) -> np.ndarray:
        """Run a prompt, store its keys and values in ``slot``, return the last position's logits.

        Args:
            slot: a free cache slot (its previous contents are overwritten).
            tokens: the prompt, ``1 <= len <= context``.

        Returns:
            ``[vocab]`` float32 logits for the next token.
        """
        logits, _ = self._prefill(slot, tokens, None)
        return logits.cpu().numpy()

    @torch.inference_mode()
    def prefill_sample(self, slot: int, tokens: Sequence[int], params: SamplingParams, uniform: float) -> int:
        """:meth:`prefill`, and pick the first token in the same graph.

        Args:
            slot: a free cache slot.
            tokens: the prompt.
            params: the request's sampling parameters.
            uniform: its draw in ``[0, 1)`` for this token (ignored when greedy).

        Returns:
            the first generated token.
        """
        rows = _SamplingRows.empty(1)
        rows.set(0, params, uniform)
        _, token = self._prefill(slot, tokens, rows)
        return int(token[0])

    @torch.inference_mode()
    def decode(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        """Advance several sequences by one token each, in one forward pass.

        Args:
            slots: their cache slots (distinct).
            tokens: each one's latest token.
            positions: where each token sits (= tokens already in its cache), ``< context``.

        Returns:
            ``[len(slots), vocab]`` float32 logits.
        """
        logits, _, at = self._decode(slots, tokens, positions, None, ())
        out = logits.cpu().numpy()
        return out[at] if self.fixed_shape else out

    @torch.inference_mode()
    def decode_sample(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int],
                      params: Sequence[SamplingParams], uniforms: Sequence[float]) -> list[int]:
        """:meth:`decode`, and pick each sequence's next token in the same graph.

        Args:
            slots: their cache slots (distinct).
            tokens: each one's latest token.
            positions: where each token sits.
            params: each one's sampling parameters.
            uniforms: each one's draw in ``[0, 1)`` for this token (ignored when greedy).

        Returns:
            the next token of each sequence, in the order of ``slots``.
        """
        if not (len(params) == len(uniforms) == len(slots)):
            raise ValueError("one SamplingParams and one uniform per sequence")
        _, picked, at = self._decode(slots, tokens, positions, params, uniforms)
        out = picked.cpu().numpy()
        ids: list[int] = (out[at] if self.fixed_shape else out).tolist()
        return ids

    # ------------------------------------------------------------------ plumbing

    def _prefill(self, slot: int, tokens: Sequence[int], rows: _SamplingRows | None) -> tuple[torch.Tensor, torch.Tensor]:
        t = len(tokens)
        if not 1 <= t <= self.cfg.context:
            raise ValueError(f"prompt of {t} tokens does not fit a context of {self.cfg.context}")
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} is outside the cache")
        ids = torch.from_numpy(np.asarray(tokens, dtype=np.int64)).to(self.device)
        sampling = self._no_sampling if rows is None else rows.tensors(self.device)
        out: tuple[torch.Tensor, torch.Tensor] = _prefill_graph(ids, slot, self._glob, self._layers, self._k, self._v, self.cfg.n_heads,
                                                                 sampling, self._never, self._stops, rows is not None and rows.nucleus)
        return out

    def _decode(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int],
                params: Sequence[SamplingParams] | None, uniforms: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        n = len(slots)
        if not (n == len(tokens) == len(positions)) or n == 0:
            raise ValueError("slots, tokens and positions must be non-empty and of equal length")
        ctx, dev = self.cfg.context, self.device
        if max(positions) >= ctx or min(positions) < 0:
            raise ValueError("a position is outside the context")
        if len(set(slots)) != n or min(slots) < 0 or max(slots) >= self.max_slots:
            raise ValueError("slots must be distinct cache slots")
        blocks = -(-(max(positions) + 1) // self.ATTN_BLOCK)
        at = np.asarray(slots, dtype=np.intp)
        rows = None if params is None else _SamplingRows.empty(self.max_slots if self.fixed_shape else n)
        if self.fixed_shape:
            # Every slot gets a row. An idle row writes to the last cache position of its slot
            # (which a live sequence there only reads after writing it itself) and attends to
            # its first position only (finite garbage, never NaN, one block).
            idx = np.empty((3, self.max_slots), dtype=np.int64)
            idx[0], idx[1], idx[2] = 0, ctx - 1, 0
            idx[0, at] = tokens
            idx[1, at] = positions
            idx[2, at] = positions
            cache_rows = self._no_rows
        else:
            idx = np.array([tokens, positions, positions], dtype=np.int64)
            cache_rows = torch.from_numpy(at.astype(np.int64)).to(dev)
        if rows is not None and params is not None:
            for r, p, u in zip(at if self.fixed_shape else range(n), params, uniforms, strict=False):
                rows.set(int(r), p, u)
        sampling = self._no_sampling if rows is None else rows.tensors(dev)
        t = torch.from_numpy(idx).to(dev)
        logits, picked = _decode_graph(t[0], t[1], t[2], cache_rows, blocks, self.ATTN_BLOCK, self._glob, self._layers,
                                       self._k, self._v, self.cfg.n_heads, sampling, self._never, self._stops,
                                       rows is not None and rows.nucleus)
        return logits, picked, at


@dataclasses.dataclass
class _SamplingRows:
    """Per-row sampling inputs of one graph call (rows without a sequence keep the defaults)."""

    values: np.ndarray  # [3, rows] float64: temperature, top_p, uniform
    ignore_eos: np.ndarray  # [rows] bool
    nucleus: bool = False

    @classmethod
    def empty(cls, n: int) -> _SamplingRows:
        values = np.zeros((3, n), dtype=np.float64)
        values[0] = values[1] = 1.0
        return cls(values, np.zeros(n, dtype=np.bool_))

    def set(self, row: int, params: SamplingParams, uniform: float) -> None:
        self.values[0, row] = params.temperature
        self.values[1, row] = params.top_p
        self.values[2, row] = uniform
        self.ignore_eos[row] = params.ignore_eos
        if params.top_p < 1.0 and params.temperature != 0.0:
            self.nucleus = True

    def tensors(self, device: torch.device) -> list[torch.Tensor]:
        v = torch.from_numpy(self.values).to(device)
        return [v[0], v[1], v[2], torch.from_numpy(self.ignore_eos).to(device)]


#: Per-layer parameters, in the order the graphs index them.
_LAYER_PARAMS = ("ln1.g", "ln1.b", "qkv.w", "qkv.b", "out.w", "out.b", "ln2.g", "ln2.b", "fc1.w", "fc1.b", "fc2.w", "fc2.b")


def _sample_step(logits: torch.Tensor, sampling: list[torch.Tensor], never: torch.Tensor, stops: torch.Tensor,
                 nucleus: bool) -> torch.Tensor:
    # The next token of every row, as sampling.sample_next picks it (in float64, one uniform per
    # non-greedy row, every operation row by row): greedy rows take the argmax; full-distribution
    # rows invert the CDF over the vocabulary in token order; nucleus rows (top_p < 1) invert it
    # over the smallest set of most probable tokens whose mass reaches top_p (stable order).
    temperature, top_p, uniform, ignore_eos = sampling[0], sampling[1], sampling[2], sampling[3]
    vocab = logits.shape[1]
    z = logits.to(torch.float64).index_fill_(1, never, float("-inf"))
    # Stop tokens are banned in the rows that ignore EOS (a few columns, not a full mask).
    z.index_copy_(1, stops, z.index_select(1, stops).masked_fill_(ignore_eos[:, None], float("-inf")))
    greedy = temperature == 0.0
    zs = z / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    zs = zs - zs.amax(1, keepdim=True)
    e = torch.exp(zs)
    cdf = torch.cumsum(e, 1)
    # The CDF never decreases, so the count of entries <= the draw is a binary search.
    picked = torch.clamp(torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)[:, 0], max=vocab - 1)
    if bool(greedy.any()):
        picked = torch.where(greedy, z.argmax(1), picked)
    if nucleus:
        probs = e / e.sum(1, keepdim=True)
        order = torch.argsort(probs, dim=1, descending=True, stable=True)
        ranked = probs.gather(1, order)
        keep = (torch.cumsum(ranked, 1) - ranked) < top_p[:, None]
        kept = torch.cumsum(torch.where(keep, ranked, torch.zeros_like(ranked)), 1)
        idx = torch.searchsorted(kept, (uniform * kept[:, -1])[:, None], right=True)[:, 0]
        idx = torch.minimum(idx, keep.sum(1) - 1)
        picked = torch.where(~greedy & (top_p < 1.0), order.gather(1, idx[:, None])[:, 0], picked)
    return picked


def _attend_one(q: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor, slot: int, length: int, blocks: int,
                n_heads: int) -> torch.Tensor:
    # One row: its keys and values gathered from the blocks, cut at its length, one attention call.
    hd = q.shape[2]
    keys = kl[:blocks, slot].transpose(0, 1).reshape(n_heads, -1, hd)[:, :length]
    values = vl[:blocks, slot].transpose(0, 1).reshape(n_heads, -1, hd)[:, :length]
    # The scale is already in q.
    a = F.scaled_dot_product_attention(q.view(1, n_heads, 1, hd), keys[None], values[None], scale=1.0)
    return a.reshape(1, n_heads * hd)


def _attend_blocks(q: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor, blocks: int,
                   block: int, gather: bool, m: int, n_heads: int) -> torch.Tensor:
    # Every row, block by block, each block one fixed-shape batched product.
    hd = q.shape[2]
    # Pass 1: scores per block and the row's maximum over all its blocks.
    scores: list[torch.Tensor] = []
    top = mask  # placeholder, replaced at j == 0
    for j in range(blocks):
        kb = kl[j].index_select(0, slots) if gather else kl[j]
        s = torch.bmm(q, kb.view(m * n_heads, block, hd).transpose(1, 2)).view(m, n_heads, block) + mask[:, :, j * block : (j + 1) * block]
        scores.append(s)
        mj = s.amax(-1, keepdim=True)
        top = mj if j == 0 else torch.maximum(top, mj)
    # Pass 2: weights, their sum and the weighted values, block by block in a fixed order.
    total = top
    out = q
    for j in range(blocks):
        vb = vl[j].index_select(0, slots) if gather else vl[j]
        p = torch.exp(scores[j] - top)
        pj = p.sum(-1, keepdim=True)
        oj = torch.bmm(p.view(m * n_heads, 1, block), vb.view(m * n_heads, block, hd))
        total = pj if j == 0 else total + pj
        out = oj if j == 0 else out + oj
    return (out.view(m, n_heads, hd) / total).reshape(m, n_heads * hd)


def _prefill_step(ids: torch.Tensor, slot: int, g: list[torch.Tensor], layers: list[list[torch.Tensor]], kc: torch.Tensor,
                  vc: torch.Tensor, n_heads: int, sampling: list[torch.Tensor], never: torch.Tensor, stops: torch.Tensor,
                  nucleus: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # One prompt, causal attention within it; its keys and values go to the slot's cache.
    t = ids.shape[0]
    d = g[0].shape[1]
    hd = d // n_heads
    n_slots, block = kc.shape[2], kc.shape[4]
    pos = torch.arange(t, device=ids.device)
    # Row of each (position, head) in a [blocks * slots * heads * block, head_dim] view of a layer.
    flat = ((((pos // block) * n_slots + slot) * n_heads)[:, None] + torch.arange(n_heads, device=ids.device)[None, :]) * block
    flat = (flat + (pos % block)[:, None]).reshape(-1)
    x = g[0][ids] + g[1][:t]
    for i in range(len(layers)):
        w = layers[i]
        qkv = F.linear(F.layer_norm(x, [d], w[0], w[1], 1e-5), w[2], w[3])
        q = qkv[:, :d].reshape(t, n_heads, hd).transpose(0, 1)
        k = qkv[:, d : 2 * d].reshape(t, n_heads, hd)
        v = qkv[:, 2 * d :].reshape(t, n_heads, hd)
        kc[i].view(-1, hd).index_copy_(0, flat, k.reshape(t * n_heads, hd))
        vc[i].view(-1, hd).index_copy_(0, flat, v.reshape(t * n_heads, hd))
        a = F.scaled_dot_product_attention(q[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True)[0]
        x = x + F.linear(a.transpose(0, 1).reshape(t, d), w[4], w[5])
        h = F.layer_norm(x, [d], w[6], w[7], 1e-5)
        x = x + F.linear(F.gelu(F.linear(h, w[8], w[9])), w[10], w[11])
    x = F.layer_norm(x[t - 1 :], [d], g[2], g[3], 1e-5)
    logits = F.linear(x, g[4], g[5])
    if sampling[0].shape[0] == 0:
        return logits[0], ids[:0]
    return logits[0], _sample_step(logits, sampling, never, stops, nucleus)


def _decode_step(
    tokens: torch.Tensor,
    write: torch.Tensor,
    attend: torch.Tensor,
    rows: torch.Tensor,
    blocks: int,
    block: int,
    g: list[torch.Tensor],
    layers: list[list[torch.Tensor]],
    kc: torch.Tensor,
    vc: torch.Tensor,
    n_heads: int,
    sampling: list[torch.Tensor],
    never: torch.Tensor,
    stops: torch.Tensor,
    nucleus: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    # One decode step as a TorchScript graph: its operations run without returning to the
    # Python interpreter between them, so the engine thread does not fight the event loop's
    # thread for the GIL at every operation (eager mode stalls badly when the loop is busy).
    # ``rows`` empty: row r is cache slot r (fixed shape); otherwise row r is slot rows[r].
    m = tokens.shape[0]
    d = g[0].shape[1]
    hd = d // n_heads
    n_slots = kc.shape[2]
    gather = rows.shape[0] > 0
    slots = rows if gather else torch.arange(m, device=tokens.device)
    # One row at a time (a model with one slot: nothing to be invariant against) attends over
    # exactly its own keys in one call; a batch goes block by block.
    single = m == 1
    length = int(attend[0]) + 1 if single else 0
    slot0 = int(slots[0]) if single else 0
    # Additive length mask over the blocks in use, [m, 1, blocks * block]: 0 up to the row's position.
    keys = torch.arange(0 if single else blocks * block, device=tokens.device)
    mask = torch.zeros([m, keys.shape[0]], dtype=kc.dtype, device=kc.device)
    mask = mask.masked_fill_(keys[None, :] > attend[:, None], float("-inf"))[:, None, :]
    # Row of each new (slot, head) key and value in a [blocks * slots * heads * block, head_dim]
    # view of a layer.
    heads = torch.arange(n_heads, device=tokens.device)
    flat = ((((write // block) * n_slots + slots) * n_heads)[:, None] + heads[None, :]) * block + (write % block)[:, None]
    flat = flat.reshape(-1)
    scale = 1.0 / math.sqrt(hd)
    x = g[0][tokens] + g[1][write]
    for i in range(len(layers)):
        w = layers[i]
        qkv = F.linear(F.layer_norm(x, [d], w[0], w[1], 1e-5), w[2], w[3])
        q = (qkv[:, :d] * scale).reshape(m * n_heads, 1, hd)
        kl = kc[i]
        vl = vc[i]
        kl.view(-1, hd).index_copy_(0, flat, qkv[:, d : 2 * d].reshape(m * n_heads, hd))
        vl.view(-1, hd).index_copy_(0, flat, qkv[:, 2 * d :].reshape(m * n_heads, hd))
        if single:
            a = _attend_one(q, kl, vl, slot0, length, blocks, n_heads)
        else:
            a = _attend_blocks(q, kl, vl, slots, mask, blocks, block, gather, m, n_heads)
        x = x + F.linear(a, w[4], w[5])
        h = F.layer_norm(x, [d], w[6], w[7], 1e-5)
        x = x + F.linear(F.gelu(F.linear(h, w[8], w[9])), w[10], w[11])
    logits = F.linear(F.layer_norm(x, [d], g[2], g[3], 1e-5), g[4], g[5])
    if sampling[0].shape[0] == 0:
        return logits, tokens[:0]
    return logits, _sample_step(logits, sampling, never, stops, nucleus)


with warnings.catch_warnings():
    # torch.jit.script is deprecated in favour of torch.compile, which needs a C++ toolchain and
    # tens of seconds of compilation per shape: too heavy for a load-test model that must start in
    # a second. TorchScript still runs here, and it is what keeps the step off the GIL.
    warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.*", category=DeprecationWarning)
    _attend_one = torch.jit.script(_attend_one)
    _attend_blocks = torch.jit.script(_attend_blocks)
    _decode_graph = torch.jit.script(_decode_step)
    _prefill_graph = torch.jit.script(_prefill_step)
