"""Component checks of ``parity``: the golden set's ``comp.*`` vectors against our functions.

Tolerances follow the golden README: QDQ functions, hash ids, top-k and candidate selections and
MoE expert ids bit-exact; Sinkhorn and MoE weights to fp32 rounding; sparse attention, compressor
latents, caches and module outputs to one bf16 ulp. Layers are taken from the tensor names, so
a golden set built on another layout is checked the same way.
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


@dataclass
class ComponentResult:
    name: str
    passed: bool
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


def _bf16_close(name: str, computed: torch.Tensor, expected: torch.Tensor, max_ulps: float = 1.0) -> ComponentResult:
    u = ulps(computed, expected, 7)
    return ComponentResult(name, u <= max_ulps, f"max {u:.2f} bf16 ulp (<= {max_ulps:g})")


def _fp32_close(name: str, computed: torch.Tensor, expected: torch.Tensor, max_ulps: float = 8.0) -> ComponentResult:
    u = ulps(computed, expected, 23)
    return ComponentResult(name, u <= max_ulps, f"max {u:.1f} fp32 ulp (<= {max_ulps:g})")


def _exact(name: str, computed: torch.Tensor, expected: torch.Tensor) -> ComponentResult:
    same = computed.shape == expected.shape and bool(torch.equal(computed.cpu(), expected.cpu()))
    return ComponentResult(name, same, "bit-exact" if same else f"differs (shape {tuple(computed.shape)})")


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
            results.append(_fp32_close(f"hc_split_sinkhorn.{part}", value, t(f"comp.hc_split_sinkhorn.{part}")))
    for key in sorted(n for n in names if n.startswith("comp.sparse_attn_") and n.endswith(".q")):
        prefix = key[: -len(".q")]
        q = t(f"{prefix}.q")[0]
        scale = 64 ** -0.5 if prefix.endswith("synth") else model.cfg.head_dim ** -0.5
        out = attention_from_lists(q, t(f"{prefix}.kv")[0], t(f"{prefix}.attn_sink"), t(f"{prefix}.topk_idxs")[0], scale)
        results.append(_bf16_close(prefix[len("comp."):], out, t(f"{prefix}.out")[0]))
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
    for key, layer in _layer_keys(tensors, r"comp\.hc_mixes_layer(\d+)_attn\.x"):
        prefix = key[: -len(".x")]
        hc = model.blocks[layer].attn_hc
        x = tensors[key][0]
        mixes = hc.mixes(x, bi)
        pre, post, comb = hc.coefficients(x, bi)
        name = prefix[len("comp."):]
        results.append(_fp32_close(f"{name}.mixes", mixes, tensors[f"{prefix}.mixes"][0], 64))
        results.append(_fp32_close(f"{name}.pre", pre, tensors[f"{prefix}.pre"][0], 64))
        results.append(_fp32_close(f"{name}.post", post, tensors[f"{prefix}.post"][0], 64))
        results.append(_fp32_close(f"{name}.comb", comb, tensors[f"{prefix}.comb"][0], 64))
    for key, layer in _layer_keys(tensors, r"comp\.moe_layer(\d+)\.x"):
        prefix, name = key[: -len(".x")], key[len("comp."): -len(".x")]
        moe = model.blocks[layer].moe
        x = tensors[key].reshape(-1, model.cfg.hidden_size)
        weights, indices = moe.router(x)
        results.append(_exact(f"{name}.indices", indices, tensors[f"{prefix}.indices"]))
        results.append(_fp32_close(f"{name}.weights", weights, tensors[f"{prefix}.weights"]))
        results.append(_bf16_close(f"{name}.out", moe(x), tensors[f"{prefix}.out"].reshape(x.shape)))
    for key, layer in _layer_keys(tensors, r"comp\.engram_layer(\d+)\.x"):
        prefix, name = key[: -len(".x")], key[len("comp."): -len(".x")]
        out = model.blocks[layer].engram(tensors[key][0], tensors[f"{prefix}.hash_ids"][0])
        results.append(_bf16_close(f"{name}.out", out, tensors[f"{prefix}.out"][0]))
    return results


def _capture_prefill(model: V41Model, ids: list[int]) -> tuple[V41Cache, ForwardState, ForwardBatch]:
    cache = V41Cache.allocate(model.cfg, num_blocks=len(ids) // 128 + 2, num_slots=1)
    table = list(range(1, len(ids) // 128 + 2))
    batch = ForwardBatch.build([ids], [0], [0], [table])
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
        k = expected.shape[-1]
        ours = torch.full((s, k), -1, dtype=torch.int32)
        for row in range(s):
            n = int(selection.counts[row])
            ours[row, :n] = (selection.entries[row, :n] + s).int()
        results.append(_exact(key[len("comp."): -len(".idxs")], ours, expected))
    for key, layer in _layer_keys(tensors, r"comp\.indexer_candidates_layer(\d+)\.mask"):
        expected = tensors[key][0]
        results.append(_exact(key[len("comp."):], state.candidates[:, : expected.shape[-1]], expected))
    for key, layer in _layer_keys(tensors, r"comp\.cache_after_prefill\.layer(\d+)\.window_kv"):
        expected = tensors[key]
        results.append(_bf16_close(key[len("comp."):], cache.window[layer][0, : expected.shape[0]], expected, 0))
    for kind, store in (("compress_kv", cache.compressed_kv), ("index_k", cache.index_keys)):
        for key, layer in _layer_keys(tensors, rf"comp\.cache_after_prefill\.layer(\d+)\.{kind}"):
            expected = tensors[key]
            blocks, rows = cache.entry_rows(layer, chunk.block_table, torch.arange(expected.shape[0]))
            results.append(_bf16_close(key[len("comp."):], store[layer][blocks, rows], expected))
    return results


def _check_engram_hash(model: V41Model, tensors) -> list[ComponentResult]:
    if "comp.engram_hash.input_ids" not in tensors or model.hasher is None:
        return []
    hasher = model.hasher
    ids = tensors["comp.engram_hash.input_ids"][0].tolist()
    cache = V41Cache.allocate(model.cfg, num_blocks=2, num_slots=1)
    one_shot = hasher(ForwardBatch.build([ids], [0], [0], [[1]]), cache)
    # the same ids hashed as a prefill of 30 tokens then single tokens must agree
    cache = V41Cache.allocate(model.cfg, num_blocks=2, num_slots=1)
    parts = [hasher(ForwardBatch.build([ids[:30]], [0], [0], [[1]]), cache)]
    parts += [hasher(ForwardBatch.build([[tok]], [30 + i], [0], [[1]]), cache) for i, tok in enumerate(ids[30:])]
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
    for key, layer in _layer_keys(tensors, r"comp\.compressor_ratio\d_layer(\d+)\.x"):
        prefix, name = key[: -len(".x")], key[len("comp."): -len(".x")]
        compressor = model.blocks[layer].attention.compressor
        x = tensors[key][0]
        n = x.shape[0]
        cache = V41Cache.allocate(model.cfg, num_blocks=2, num_slots=1)

        def run(rows: slice, start: int):
            batch = ForwardBatch.build([[0] * (rows.stop - rows.start)], [start], [0], [[1]])
            return compressor.latents(x[rows], batch, cache)[0]

        results.append(_bf16_close(f"{name}.latent_prefill{n - 1}", run(slice(0, n - 1), 0),
                                   tensors[f"{prefix}.latent_prefill{n - 1}"][0]))
        if f"{prefix}.kv_state_after_prefill{n - 1}" in tensors:
            open_rows = tensors[f"{prefix}.kv_state_after_prefill{n - 1}"].shape[1]
            results.append(_fp32_close(f"{name}.kv_state", cache.tail_kv[layer][0, :open_rows],
                                       tensors[f"{prefix}.kv_state_after_prefill{n - 1}"][0]))
            results.append(_fp32_close(f"{name}.score_state", cache.tail_score[layer][0, :open_rows],
                                       tensors[f"{prefix}.score_state_after_prefill{n - 1}"][0]))
        results.append(_bf16_close(f"{name}.latent_decode_pos{n - 1}", run(slice(n - 1, n), n - 1),
                                   tensors[f"{prefix}.latent_decode_pos{n - 1}"][0]))
        if f"{prefix}.latent_prefill{n}" in tensors:
            cache = V41Cache.allocate(model.cfg, num_blocks=2, num_slots=1)
            results.append(_bf16_close(f"{name}.latent_prefill{n}", run(slice(0, n), 0),
                                       tensors[f"{prefix}.latent_prefill{n}"][0]))
    return results
