"""Component checks of ``parity``: the golden set's ``comp.*`` vectors against our functions.

Every check reports two things, one per verdict level of ``parity``:

* ``bit_exact``: the vector is identical to the golden one (0 ulp). The BIT-EXACT verdict needs
  this of every component; on the golden set's own platform everything is bit-exact.
* ``close``: the vector is within the tolerance a faithful implementation meets on any platform.
  CPU GEMM kernels differ between builds and ISAs, and a one-ulp difference anywhere upstream can
  flip a bf16 element or a near-tied selection, so ulp bounds say nothing there. The tolerances
  are therefore by kind of output:

  - pure functions of the golden inputs with integer or quantized outputs (QDQ bytes and scales,
    hash ids and their constants): exact everywhere, since IEEE rounding defines them;
  - float vectors computed from golden inputs by one function or module: relative L2 error
    ``|c - e| / |e|`` within ``FP32_REL_TOL`` (fp32 results: summation order moves them by
    ~1e-7) or ``BF16_REL_TOL`` (bf16 results, where one rounding flip costs ~4e-3 of an element);
  - caches after a whole 33-token forward: within ``FORWARD_REL_TOL``, since a flip in one layer
    reaches every later layer (faithful runs on other platforms: up to 4.6e-2);
  - selections computed from scores (indexer top-k, candidate blocks, MoE experts): at least
    ``MIN_OVERLAP`` of the golden selection is selected too (near ties may resolve differently).

A mismatch in shape is never close. Layers are taken from the tensor names, so a golden set built
on another layout is checked the same way. Inputs go to the model's device and results come back
to the CPU, so the checks run on CUDA too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .attention import ForwardState
from .batch import ForwardBatch
from .cache import V41Cache
from .mhc import split_sinkhorn
from .quant import fp4_quantize, fp4_qdq, fp8_qdq, fp8_quantize
from .sparse_attention import sparse_attention
from .transformer import V41Model

# Measurements behind these: docs/numerics.md, "The verdict".
FP32_REL_TOL = 1e-5
BF16_REL_TOL = 1e-2
FORWARD_REL_TOL = 1e-1
MIN_OVERLAP = 0.9


@dataclass
class ComponentResult:
    name: str
    bit_exact: bool  # identical to the golden vector
    close: bool  # within the statistical tolerance of its kind
    detail: str


def ulps(computed: torch.Tensor, expected: torch.Tensor, mantissa_bits: int) -> float:
    """Largest difference in units of the last place of the larger magnitude (0 when equal)."""
    a, b = computed.double(), expected.double()
    diff = (a - b).abs()
    if bool((diff == 0).all()):
        return 0.0
    magnitude = torch.maximum(a.abs(), b.abs()).clamp_min(2.0 ** -126)
    ulp = torch.exp2(torch.floor(torch.log2(magnitude)) - mantissa_bits)
    return float((diff / ulp).max())


def relative_error(computed: torch.Tensor, expected: torch.Tensor) -> float:
    """``|c - e|_2 / |e|_2`` over the whole vector (0 when both are zero)."""
    a, b = computed.double(), expected.double()
    norm = float(b.norm())
    diff = float((a - b).norm())
    return diff / norm if norm else (0.0 if diff == 0 else float("inf"))


def _shape_mismatch(name: str, computed: torch.Tensor, expected: torch.Tensor) -> ComponentResult | None:
    if computed.shape == expected.shape:
        return None
    return ComponentResult(name, False, False, f"shape {tuple(computed.shape)} vs golden {tuple(expected.shape)}")


def _value(name: str, computed: torch.Tensor, expected: torch.Tensor, mantissa_bits: int,
           rel_tol: float) -> ComponentResult:
    """A float vector: bit-exact, else close when its relative L2 error is within ``rel_tol``."""
    computed, expected = computed.cpu(), expected.cpu()
    mismatch = _shape_mismatch(name, computed, expected)
    if mismatch:
        return mismatch
    if torch.equal(computed, expected):
        return ComponentResult(name, True, True, "identical")
    unit = "bf16" if mantissa_bits == 7 else "fp32"
    rel = relative_error(computed, expected)
    detail = f"max {ulps(computed, expected, mantissa_bits):.0f} {unit} ulp, rel {rel:.1e} (<= {rel_tol:g})"
    return ComponentResult(name, False, rel <= rel_tol, detail)


def _bf16(name: str, computed: torch.Tensor, expected: torch.Tensor, rel_tol: float = BF16_REL_TOL) -> ComponentResult:
    return _value(name, computed, expected, 7, rel_tol)


def _fp32(name: str, computed: torch.Tensor, expected: torch.Tensor) -> ComponentResult:
    return _value(name, computed, expected, 23, FP32_REL_TOL)


def _exact(name: str, computed: torch.Tensor, expected: torch.Tensor) -> ComponentResult:
    """A pure function of golden inputs with integer or quantized output: exact on any platform."""
    computed, expected = computed.cpu(), expected.cpu()
    same = computed.shape == expected.shape and bool(torch.equal(computed, expected))
    return ComponentResult(name, same, same, "identical" if same else "differs (must be exact on any platform)")


def _selection(name: str, computed: torch.Tensor, expected: torch.Tensor) -> ComponentResult:
    """Selected ids per row (``-1`` = none): the fraction of the golden selections we also select."""
    computed, expected = computed.cpu(), expected.cpu()
    mismatch = _shape_mismatch(name, computed, expected)
    if mismatch:
        return mismatch
    if torch.equal(computed, expected):
        return ComponentResult(name, True, True, "identical")
    chosen = expected >= 0
    hits = (expected.unsqueeze(-1) == computed.unsqueeze(-2)).any(-1) & chosen
    overlap = float(hits.sum()) / max(int(chosen.sum()), 1)
    return ComponentResult(name, False, overlap >= MIN_OVERLAP,
                           f"{overlap:.1%} of the selection agrees (>= {MIN_OVERLAP:.0%})")


def _mask(name: str, computed: torch.Tensor, expected: torch.Tensor) -> ComponentResult:
    """A boolean selection mask: the fraction of the golden selected entries we also select."""
    computed, expected = computed.cpu().bool(), expected.cpu().bool()
    mismatch = _shape_mismatch(name, computed, expected)
    if mismatch:
        return mismatch
    if torch.equal(computed, expected):
        return ComponentResult(name, True, True, "identical")
    overlap = float((computed & expected).sum()) / max(int(expected.sum()), 1)
    return ComponentResult(name, False, overlap >= MIN_OVERLAP,
                           f"{overlap:.1%} of the selection agrees (>= {MIN_OVERLAP:.0%})")


def attention_from_lists(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, index: torch.Tensor, scale: float):
    """q [T, H, D], kv [N, D], index [T, L] with -1 holes (the kernel's own lists) -> our output."""
    valid = index >= 0
    gathered = kv[index.clamp(min=0).long()]
    widths = torch.full((q.shape[0],), index.shape[1])
    return sparse_attention(q, gathered, valid, widths, sink, scale)


def check_components(model: V41Model, golden) -> list[ComponentResult]:
    tensors = golden.tensors
    names = set(tensors)
    results: list[ComponentResult] = []

    def t(key: str) -> torch.Tensor:
        return tensors[key]

    # the reference's functions on golden inputs, on the CPU (what the reference defines them as)
    if "comp.act_quant.x" in names:
        x = t("comp.act_quant.x")
        q, s = fp8_quantize(x, 32)
        results.append(_exact("act_quant.q", q.view(torch.uint8), t("comp.act_quant.q").view(torch.uint8)))
        results.append(_exact("act_quant.s", s, t("comp.act_quant.s").float()))
        results.append(_exact("act_quant.qdq", fp8_qdq(x, 32), t("comp.act_quant.qdq")))
    for key, block, e4m3 in (("fp4_act_quant_ue8m0_g32", 32, False), ("fp4_act_quant_e4m3_g16", 16, True)):
        if f"comp.{key}.x" in names:
            x = t(f"comp.{key}.x")
            packed, s = fp4_quantize(x, block, e4m3)
            results.append(_exact(f"{key}.packed", packed, t(f"comp.{key}.packed")))
            results.append(_exact(f"{key}.s", s, t(f"comp.{key}.s").float()))
            results.append(_exact(f"{key}.qdq", fp4_qdq(x, block, e4m3), t(f"comp.{key}.qdq")))
    if "comp.hc_split_sinkhorn.mixes" in names:
        hc = model.cfg.hc_mult
        pre, post, comb = split_sinkhorn(t("comp.hc_split_sinkhorn.mixes"), t("comp.hc_split_sinkhorn.hc_scale"),
                                         t("comp.hc_split_sinkhorn.hc_base"), hc, model.cfg.hc_sinkhorn_iters,
                                         model.cfg.hc_eps)
        for part, value in (("pre", pre), ("post", post), ("comb", comb)):
            results.append(_fp32(f"hc_split_sinkhorn.{part}", value, t(f"comp.hc_split_sinkhorn.{part}")))
    for key in sorted(n for n in names if n.startswith("comp.sparse_attn_") and n.endswith(".q")):
        prefix = key[: -len(".q")]
        q = t(f"{prefix}.q")[0]
        scale = 64 ** -0.5 if prefix.endswith("synth") else model.cfg.head_dim ** -0.5
        out = attention_from_lists(q, t(f"{prefix}.kv")[0], t(f"{prefix}.attn_sink"), t(f"{prefix}.topk_idxs")[0], scale)
        results.append(_bf16(prefix[len("comp."):], out, t(f"{prefix}.out")[0]))
    # the model's modules, on the model's device
    results += _check_layer_modules(model, tensors)
    results += _check_capture_forward(model, tensors)
    results += _check_engram_hash(model, tensors)
    results += _check_compressors(model, tensors)
    return results


def _layer_keys(names, pattern: str) -> list[tuple[str, int]]:
    found = []
    for name in names:
        match = re.fullmatch(pattern, name)
        if match:
            found.append((name, int(match.group(1))))
    return sorted(found)


def _check_layer_modules(model: V41Model, tensors) -> list[ComponentResult]:
    results = []
    bi = model.options.batch_invariant
    dev = model.device
    for key, layer in _layer_keys(tensors, r"comp\.hc_mixes_layer(\d+)_attn\.x"):
        prefix = key[: -len(".x")]
        hc = model.blocks[layer].attn_hc
        x = tensors[key][0].to(dev)
        mixes = hc.mixes(x, bi)
        pre, post, comb = hc.coefficients(x)
        name = prefix[len("comp."):]
        for part, value in (("mixes", mixes), ("pre", pre), ("post", post), ("comb", comb)):
            results.append(_fp32(f"{name}.{part}", value, tensors[f"{prefix}.{part}"][0]))
    for key, layer in _layer_keys(tensors, r"comp\.moe_layer(\d+)\.x"):
        prefix, name = key[: -len(".x")], key[len("comp."): -len(".x")]
        moe = model.blocks[layer].moe
        x = tensors[key].reshape(-1, model.cfg.hidden_size).to(dev)
        weights, indices = moe.router(x)
        results.append(_selection(f"{name}.indices", indices, tensors[f"{prefix}.indices"]))
        results.append(_fp32(f"{name}.weights", weights, tensors[f"{prefix}.weights"]))
        results.append(_bf16(f"{name}.out", moe(x), tensors[f"{prefix}.out"].reshape(x.shape)))
    for key, layer in _layer_keys(tensors, r"comp\.engram_layer(\d+)\.x"):
        prefix, name = key[: -len(".x")], key[len("comp."): -len(".x")]
        out = model.blocks[layer].engram(tensors[key][0].to(dev), tensors[f"{prefix}.hash_ids"][0].to(dev))
        results.append(_bf16(f"{name}.out", out, tensors[f"{prefix}.out"][0]))
    return results


def _capture_prefill(model: V41Model, ids: list[int]) -> tuple[V41Cache, ForwardState, ForwardBatch]:
    blocks = len(ids) // 128 + 1
    cache = V41Cache.allocate(model.cfg, num_blocks=blocks + 1, num_slots=1, device=model.device)
    batch = ForwardBatch.build([ids], [0], [0], [list(range(1, blocks + 1))], device=model.device)
    state = ForwardState()
    model.forward(batch, cache, state)
    return cache, state, batch


def _check_capture_forward(model: V41Model, tensors) -> list[ComponentResult]:
    """Indexer selections, candidates and caches after the capture prefill."""
    if "comp.capture.input_ids" not in tensors:
        return []
    ids = tensors["comp.capture.input_ids"].tolist()
    s = len(ids)
    cache, state, batch = _capture_prefill(model, ids)
    chunk = batch.chunks[0]
    results = []
    for key, layer in _layer_keys(tensors, r"comp\.indexer_topk_layer(\d+)\.idxs"):
        expected = tensors[key][0]
        selection = state.selections[layer]
        counts, entries = selection.counts.cpu(), selection.entries.cpu()
        k = expected.shape[-1]
        ours = torch.full((s, k), -1, dtype=torch.int32)
        for row in range(s):
            n = int(counts[row])
            ours[row, :n] = (entries[row, :n] + s).int()
        results.append(_selection(key[len("comp."): -len(".idxs")], ours, expected))
    for key, layer in _layer_keys(tensors, r"comp\.indexer_candidates_layer(\d+)\.mask"):
        expected = tensors[key][0]
        results.append(_mask(key[len("comp."):], state.candidates[:, : expected.shape[-1]], expected))
    for key, layer in _layer_keys(tensors, r"comp\.cache_after_prefill\.layer(\d+)\.window_kv"):
        expected = tensors[key]
        ring_rows = torch.arange(min(expected.shape[0], model.cfg.sliding_window), device=cache.device)
        results.append(_bf16(key[len("comp."):], cache.read_window(layer, torch.zeros_like(ring_rows), ring_rows),
                             expected, FORWARD_REL_TOL))
    for kind, read in (("compress_kv", cache.read_compressed_kv), ("index_k", cache.read_index_keys)):
        for key, layer in _layer_keys(tensors, rf"comp\.cache_after_prefill\.layer(\d+)\.{kind}"):
            expected = tensors[key]
            entries = torch.arange(expected.shape[0], device=chunk.block_table.device)
            blocks, rows = cache.entry_rows(layer, chunk.block_table, entries)
            results.append(_bf16(key[len("comp."):], read(layer, blocks, rows), expected, FORWARD_REL_TOL))
    return results


def _check_engram_hash(model: V41Model, tensors) -> list[ComponentResult]:
    if "comp.engram_hash.input_ids" not in tensors or model.hasher is None:
        return []
    hasher, dev = model.hasher, model.device
    ids = tensors["comp.engram_hash.input_ids"][0].tolist()
    cache = V41Cache.allocate(model.cfg, num_blocks=2, num_slots=1, device=dev)
    one_shot = hasher(ForwardBatch.build([ids], [0], [0], [[1]], device=dev), cache)
    # the same ids hashed as a prefill of 30 tokens then single tokens must agree
    cache = V41Cache.allocate(model.cfg, num_blocks=2, num_slots=1, device=dev)
    parts = [hasher(ForwardBatch.build([ids[:30]], [0], [0], [[1]], device=dev), cache)]
    parts += [hasher(ForwardBatch.build([[tok]], [30 + i], [0], [[1]], device=dev), cache)
              for i, tok in enumerate(ids[30:])]
    return [
        _exact("engram_hash.hash_ids", one_shot, tensors["comp.engram_hash.hash_ids"][0]),
        _exact("engram_hash.hash_ids (prefill+decode)", torch.cat(parts), tensors["comp.engram_hash.hash_ids"][0]),
        _exact("engram_hash.multipliers", hasher.multipliers, tensors["comp.engram_hash.multipliers"]),
        _exact("engram_hash.primes", hasher.primes, tensors["comp.engram_hash.primes"]),
        _exact("engram_hash.offsets", hasher.offsets, tensors["comp.engram_hash.offsets"]),
        _exact("engram_hash.token_map", hasher.token_map[: tensors["comp.engram_hash.token_map"].numel()],
               tensors["comp.engram_hash.token_map"]),
    ]


def _check_compressors(model: V41Model, tensors) -> list[ComponentResult]:
    """Compressor of a kv-source layer: a 17-token prefill, then the 18th token as a decode step."""
    results = []
    dev = model.device
    for key, layer in _layer_keys(tensors, r"comp\.compressor_ratio\d_layer(\d+)\.x"):
        prefix, name = key[: -len(".x")], key[len("comp."): -len(".x")]
        compressor = model.blocks[layer].attention.compressor
        x = tensors[key][0].to(dev)
        n = x.shape[0]
        cache = V41Cache.allocate(model.cfg, num_blocks=2, num_slots=1, device=dev)

        def run(rows: slice, start: int):
            batch = ForwardBatch.build([[0] * (rows.stop - rows.start)], [start], [0], [[1]], device=dev)
            return compressor.latents(x[rows], batch, cache)[0]

        results.append(_bf16(f"{name}.latent_prefill{n - 1}", run(slice(0, n - 1), 0),
                             tensors[f"{prefix}.latent_prefill{n - 1}"][0]))
        if f"{prefix}.kv_state_after_prefill{n - 1}" in tensors:
            open_rows = tensors[f"{prefix}.kv_state_after_prefill{n - 1}"].shape[1]
            results.append(_fp32(f"{name}.kv_state", cache.tail_kv[layer][0, :open_rows],
                                 tensors[f"{prefix}.kv_state_after_prefill{n - 1}"][0]))
            results.append(_fp32(f"{name}.score_state", cache.tail_score[layer][0, :open_rows],
                                 tensors[f"{prefix}.score_state_after_prefill{n - 1}"][0]))
        results.append(_bf16(f"{name}.latent_decode_pos{n - 1}", run(slice(n - 1, n), n - 1),
                             tensors[f"{prefix}.latent_decode_pos{n - 1}"][0]))
        if f"{prefix}.latent_prefill{n}" in tensors:
            cache = V41Cache.allocate(model.cfg, num_blocks=2, num_slots=1, device=dev)
            results.append(_bf16(f"{name}.latent_prefill{n}", run(slice(0, n), 0),
                                 tensors[f"{prefix}.latent_prefill{n}"][0]))
    return results
