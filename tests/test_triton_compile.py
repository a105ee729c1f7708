"""Every Triton kernel compiles for the GPU it is written for (Hopper, sm_90), on any machine.

The interpreter runs the kernels' arithmetic on CPU (``test_triton_kernels.py``) but not their
compilation: type rules, constexpr branches and layouts are only checked by the compiler. This
compiles each kernel, in each of its formats and tile configs, to a cubin with Triton's bundled
toolchain (no GPU needed), and checks that the matrix products use Hopper's warpgroup instructions
(``wgmma``), on which the batch-invariance argument of ``tile_configs.py`` rests. Some kernels are
also checked for register spills inside their loops (local-memory traffic in their SASS between a
label and the branch back to it), compiled as their launchers specialize them (16-aligned pointers,
sizes and strides).

The test process runs Triton in interpreter mode, which replaces every kernel by a Python stand-in,
so the compilation runs in a child process without ``TRITON_INTERPRET`` (this file, run as a script).
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

ROOT = Path(__file__).resolve().parent.parent


def test_every_kernel_compiles_for_hopper_with_wgmma():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # as on the GPU (and silences a warning)
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) >= 20, done.stdout  # every kernel x format x config reported
    assert all(line.endswith("ok") for line in lines), done.stdout


def test_lane_tensor_check_tells_one_element_per_thread_from_others():
    asm = 'tt.elementwise_inline_asm "mov.u32 $0, %laneid;" %i : tensor<128xi32, {}> -> tensor<128xi32, {}>'
    one = "#blocked3 = #ttg.blocked<{sizePerThread = [1], threadsPerWarp = [32], warpsPerCTA = [4], order = [0]}>"
    four = "#blocked3 = #ttg.blocked<{sizePerThread = [4], threadsPerWarp = [32], warpsPerCTA = [1], order = [0]}>"
    use = asm.format("#blocked3", "#blocked3")
    assert _lane_tensors_problems(f"{one}\n{use}\n", 4) == []
    assert "not one element per thread" in _lane_tensors_problems(f"{four}\n{use}\n", 4)[0]
    assert _lane_tensors_problems(one, 4) == ["no lane-id or tensor-core inline assembly found"]


def test_dependent_launch_check_finds_work_before_the_wait():
    wait, start = "griddepcontrol.wait; // dummy %r1", "griddepcontrol.launch_dependents; // dummy %r2"
    weight, x = "ld.global.v4.b32 { %r3, %r4, %r5, %r6 }, [ %rd1 + 0 ];", "ld.global.b16 { %rs1 }, [ %rd2 + 0 ];"
    store, count = "st.global.b32 [ %rd3 + 0 ], { %r7 };", "atom.global.gpu.acq_rel.add.u32 %r8, [ %rd4 + 0 ], %r9;"
    assert _dependent_launch_problems("\n".join([weight, wait, start, x, store, count]), prefetch=True) == []
    assert _dependent_launch_problems("\n".join([wait, start, x, store]), prefetch=False) == []
    fetched = "prefetch.global.L2 [ %rd5 + 0 ];"  # a weight line fetched into L2 counts as a load
    assert _dependent_launch_problems("\n".join([fetched, wait, x, start, store]), prefetch=True) == []
    assert _dependent_launch_problems("\n".join([fetched, wait, start]), prefetch=False) == [
        "loads 1 values before its wait"]
    assert _dependent_launch_problems("\n".join([wait, start, weight]), prefetch=True) == [
        "loads no weight before its wait"]
    assert _dependent_launch_problems("\n".join([x, wait, start]), prefetch=False) == ["loads 1 values before its wait"]
    assert _dependent_launch_problems("\n".join([weight, count, wait, start]), prefetch=True) == [
        "writes global memory before its wait"]
    assert _dependent_launch_problems("\n".join([weight, start, wait, store]), prefetch=True) == [
        "lets the next kernel start before its own wait"]
    assert _dependent_launch_problems("\n".join([weight, x, store]), prefetch=True) == [
        "no griddepcontrol.wait or griddepcontrol.launch_dependents"]


# ----------------------------------------------------------------------------- the child process
def _local_memory_in_loops(sass: str) -> list[str]:
    """Problems if a loop of the kernel (a backward branch to a label) spills registers to local memory
    (STL / LDL), or, in a kernel without loops, if it spills at all. Spills before or after the loops,
    of a few values kept across them, cost next to nothing."""
    lines = sass.splitlines()
    labels = {line.strip().rstrip(":"): i for i, line in enumerate(lines) if re.match(r"\.?L\w*:$", line.strip())}
    loops = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"BRA\W+(\.?L\w+)", line)) and labels.get(m.group(1), i) < i - 1]
    spills = [i for i, line in enumerate(lines) if re.search(r"\b(STL|LDL)\b", line)]
    if not loops and spills:
        return ["spills registers to local memory"]
    if any(start <= i <= end for i in spills for start, end in loops):
        return ["spills registers to local memory inside a loop"]
    return []


def _dependent_launch_problems(ptx: str, prefetch: bool) -> list[str]:
    """Problems of a kernel compiled for programmatic dependent launch (``triton_dependent_launch``): it
    must wait for the previous kernel, let the next one start after that, and write nothing (store,
    atomic) before its wait; with ``prefetch`` it loads (or fetches into L2, or has the tensor memory
    accelerator copy) some weight before the wait, without it nothing."""
    lines = ptx.splitlines()
    wait = next((i for i, line in enumerate(lines) if "griddepcontrol.wait" in line), None)
    start = next((i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line), None)
    if wait is None or start is None:
        return ["no griddepcontrol.wait or griddepcontrol.launch_dependents"]
    problems = [] if wait < start else ["lets the next kernel start before its own wait"]
    before = lines[:wait]
    if any(re.search(r"\b(st|atom|red)\.global", line) for line in before):
        problems.append("writes global memory before its wait")
    loads = sum(bool(re.search(r"\b(ld|prefetch)\.global|cp\.async\.bulk\.tensor", line)) for line in before)
    if prefetch and not loads:
        problems.append("loads no weight before its wait")
    if not prefetch and loads:
        problems.append(f"loads {loads} values before its wait")
    return problems


def _lane_tensors_problems(ttgir: str, warps: int) -> list[str]:
    """Problems if an inline assembly that reads the lane id or runs a warp's tensor-core instruction
    (``triton_mma_experts``) works on a tensor other than one element per thread: such a kernel computes
    each thread's addresses from its hardware lane id and needs all 32 lanes in the instruction."""
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.blocked<.*>)$", ttgir, flags=re.M))
    one_each = f"sizePerThread = [1], threadsPerWarp = [32], warpsPerCTA = [{warps}], order = [0]"
    problems = []
    asm_lines = [line for line in ttgir.splitlines() if "elementwise_inline_asm" in line
                 and ("%laneid" in line or "mma.sync" in line)]
    if not asm_lines:
        problems.append("no lane-id or tensor-core inline assembly found")
    for line in asm_lines:
        for name in set(re.findall(r"tensor<\d+x\w+, (#\w+)>", line)):
            if one_each not in layouts.get(name, ""):
                problems.append(f"inline assembly on {name} = {layouts.get(name)}, not one element per thread")
    return problems


def main() -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from model.cache_formats import COMPRESSED_KV, INDEX_KEYS, WINDOW_KV
    from model.kernels import (tile_configs, triton_align_pairs, triton_bf16_mm, triton_cache_codec,
                               triton_decode_mm, triton_engram, triton_gemv, triton_greedy, triton_mma_experts,
                               triton_join_lists, triton_fp4_round_trip, triton_hc_coefficients, triton_index_scores,
                               triton_mhc, triton_moe, triton_moe_sum, triton_ngram_hash, triton_rms_norm, triton_rope,
                               triton_route, triton_scaled_mm, triton_sinkhorn, triton_sparse_attention,
                               triton_sublayer_input, triton_top_entries, triton_window_kv)

    hopper = GPUTarget("cuda", 90, 32)

    def check(label: str, fn, types: dict[str, str], constants: dict, cfg=None, wgmma: bool = True,
              options: dict | None = None, aligned: tuple[str, ...] = (), spill_free: bool = False,
              inspect=None, pdl: bool = False, prefetch: bool = False) -> None:
        """``pdl``: compiled for programmatic dependent launch (its ``PDL`` and ``launch_pdl`` set together,
        as ``triton_dependent_launch.launch_arguments`` sets them), its PTX checked for the order of its
        wait (``prefetch``: it loads weights before it)."""
        signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
        if options is None:
            options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages} if cfg else {"num_warps": 4}
        if "PDL" in fn.arg_names:
            constants = {**constants, "PDL": pdl}
            options = {**options, "launch_pdl": pdl}
            label += f" pdl={pdl}"
        attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
        source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
        kernel = triton.compile(source, target=hopper, options=options)
        problems = []
        if wgmma and "wgmma" not in kernel.asm["ptx"]:
            problems.append("compiled without wgmma")
        if spill_free:
            problems += _local_memory_in_loops(kernel.asm["sass"])
        if inspect is not None:
            problems += inspect(kernel)
        if pdl:
            problems += _dependent_launch_problems(kernel.asm["ptx"], prefetch)
        print(f"{label}: {', '.join(problems) or 'ok'}")

    def register_fed(warps: int, instruction: str):
        """The checks of a kernel that feeds the tensor cores from registers: one element per thread in
        its lane tensors, and its m16n8k16 instruction in the SASS."""
        return lambda kernel: _lane_tensors_problems(kernel.asm["ttgir"], warps) + (
            [] if instruction in kernel.asm["sass"] else [f"no {instruction} tensor-core instruction"])

    def scalars(names: str) -> dict[str, str]:
        return {name: "i32" for name in names.split()}

    for round_trip, fragment_columns, pdl in ((False, False, False), (True, False, False), (True, True, False),
                                              (True, True, True)):
        types = {"x_ptr": "*bf16", "q_ptr": "*bf16" if round_trip else "*fp16", "s_ptr": "*fp32",
                 **scalars("M K stride_x stride_q stride_s")}
        check(f"act_quant round_trip={round_trip} fragment_columns={fragment_columns}",
              triton_scaled_mm._act_quant_kernel, types,
              {"BLOCK_ROWS": 4, "BLOCK_COLS": 512, "ROUND_TRIP": round_trip, "FRAGMENT_COLUMNS": fragment_columns},
              wgmma=False, pdl=pdl)

    for _, cfg in tile_configs._BF16_MM_TABLE:
        for b_fmt, out_f32 in ((0, False), (2, True)):  # FP8 linears and wo_a; the bf16 head
            types = {"a_ptr": "*bf16", "w_ptr": "*u8" if b_fmt == 0 else "*bf16",
                     "s_ptr": "*u8" if b_fmt == 0 else "*bf16", "c_ptr": "*fp32" if out_f32 else "*bf16",
                     **scalars("M N K stride_am stride_ag stride_wn stride_wg stride_sn stride_sg stride_cm stride_cg")}
            check(f"bf16_mm fmt={b_fmt} {cfg}", triton_bf16_mm._block_scaled_gemm_kernel, types,
                  {"B_FMT": b_fmt, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": 64,
                   "OUT_F32": out_f32, "EXACT_DOT": False}, cfg)

    for _, cfg in tile_configs._SCALED_MM_TABLE:
        for b_fmt in (0, 1):
            types = {"q_ptr": "*fp16", "qs_ptr": "*fp32", "w_ptr": "*u8", "ws_ptr": "*u8", "c_ptr": "*bf16",
                     **scalars("M N K stride_qm stride_qsm stride_wn stride_wsn stride_cm")}
            check(f"scaled_mm fmt={b_fmt} {cfg}", triton_scaled_mm._scaled_mm_kernel, types,
                  {"B_FMT": b_fmt, "BLOCK_T": cfg.block_m, "BLOCK_W": cfg.block_n, "INTERPRETED": False}, cfg)

    index = {name: "*i64" for name in ("pair_token_ptr", "sorted_pair_ptr", "expert_start_ptr", "expert_count_ptr",
                                        "block_expert_ptr", "block_index_ptr")}
    weights = {name: "*u8" for name in ("w1_ptr", "s1_ptr", "w3_ptr", "s3_ptr", "w2_ptr", "s2_ptr")}
    gate_up = {"x_ptr": "*bf16", "pair_weight_ptr": "*fp32", "h_ptr": "*bf16", "limit": "fp32", **index, **weights,
               **scalars("D INTER stride_x stride_we stride_wn stride_se stride_sn stride_h")}
    down = {"h_ptr": "*bf16", "out_ptr": "*bf16", **index, **weights,
            **scalars("INTER D stride_h stride_out stride_we stride_wn stride_se stride_sn")}
    aligned = tuple(name for name in triton_moe._gate_up_kernel.arg_names if name.endswith("_ptr")) + (
        "D", "INTER", "stride_x", "stride_we", "stride_se", "stride_h", "stride_out")
    def token_tiles(block_t: int):
        """The check that a routed-experts kernel multiplies a tile of each width it may narrow a block to
        (``triton_moe``: a quarter, a half and all of a block of at least 4 x ``MIN_WIDTH`` tokens): one
        ``wgmma`` shape ``m64nWk16`` per width ``W``."""
        narrowest = triton_moe.MIN_WIDTH.value
        widths = {block_t // 4, block_t // 2, block_t} if block_t >= 4 * narrowest else {block_t}

        def problems(kernel) -> list[str]:
            found = {int(n) for n in re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", kernel.asm["ptx"])}
            return [] if found == widths else [f"token tiles {sorted(found)} wide, not {sorted(widths)}"]
        return problems

    for _, cfg in tile_configs._MOE_TABLE:
        for b_fmt in (1, 0, 3):  # FP4 rows, FP8, FP4 fragments
            constants = {"B_FMT": b_fmt, "BLOCK_T": cfg.block_m, "BLOCK_W": cfg.block_n,
                         "BLOCK_K": triton_moe.BLOCK_K, "EVEN_K": True, "INTERPRETED": False}
            for name, fn, types in (("gate_up", triton_moe._gate_up_kernel, gate_up),
                                    ("down", triton_moe._down_kernel, down)):
                check(f"moe {name} fmt={b_fmt} {cfg}", fn, types, constants, cfg, spill_free=b_fmt == 3,
                      aligned=tuple(a for a in aligned if a in fn.arg_names), inspect=token_tiles(cfg.block_m))

    decode = {"a_ptr": "*bf16", **scalars("M N N2 K k_per_split stride_am stride_ag stride_wn stride_wg stride_sn "
                                           "stride_sg stride_os stride_om")}
    # what the JIT marks at run time for the real shapes (every pointer, size and stride a multiple of 16 there);
    # without the group strides' hint the loads of a group's rows are single bytes, not pipelined, and spill
    decode_aligned = ("a_ptr", "w_ptr", "s_ptr", "w2_ptr", "s2_ptr", "out_ptr", "N", "N2", "K", "k_per_split",
                      "stride_am", "stride_ag", "stride_wn", "stride_wg", "stride_sn", "stride_sg", "stride_os",
                      "stride_om")

    def copied_ahead(kernel) -> list[str]:  # the pipeline's asynchronous copies into shared memory
        return [] if "LDGSTS" in kernel.asm["sass"] else ["no asynchronous copy: the loads are not pipelined"]

    # the tables' rows and the launches' own rows (the grouped wo_a's: FP8 only)
    decode_rows = [(bound, cfg, True) for bound, cfg in tile_configs._DECODE_MM_TABLE] + \
        [(bound, cfg, False) for rows in tile_configs._DECODE_MM_BY_SHAPE.values() for bound, cfg in rows]
    for bound, cfg, any_format in decode_rows:
        block_t = max(16, triton.next_power_of_2(bound))
        # wo_a (one split: its output's FP8 round trip in the epilogue); the head
        formats = ((0, True, False), (0, False, False), (2, False, True))
        for b_fmt, partial, out_f32 in formats if any_format else formats[:2]:
            w_type = "*u8" if b_fmt == 0 else "*bf16"
            types = {**decode, "w_ptr": w_type, "s_ptr": w_type, "w2_ptr": w_type, "s2_ptr": w_type,
                     "out_ptr": "*fp32" if partial or out_f32 else "*bf16"}
            element = 1 if b_fmt == 0 else 2
            check(f"decode_mm fmt={b_fmt} partial={partial} {cfg}", triton_decode_mm._decode_mm_kernel, types,
                  {"B_FMT": b_fmt, "BLOCK_T": block_t, "BLOCK_W": cfg.block_w, "BLOCK_K": cfg.block_k,
                   "EVEN_K": True, "SCALE_WORDS": b_fmt == 0, "PARTIAL": partial, "OUT_F32": out_f32,
                   "ROUND_TRIP": b_fmt == 0 and not partial, "LINE": 128 // element,
                   "FETCH_LINES": triton_decode_mm.fetch_lines(cfg, element), "EXACT_DOT": False}, cfg,
                  aligned=decode_aligned, spill_free=True, inspect=copied_ahead, pdl=partial, prefetch=True)
    def scales_copied_ahead(kernel) -> list[str]:  # the scale words too: 4-byte asynchronous copies
        return copied_ahead(kernel) + ([] if re.search(r"LDGSTS\.E\s", kernel.asm["sass"]) else
                                       ["the scale words are not copied ahead"])

    fp8_rows = [*tile_configs._FP8_DECODE_TABLE,  # the table's rows, then the launches' own
                *(row for rows in tile_configs._FP8_DECODE_BY_SHAPE.values() for row in rows)]
    for bound, cfg in fp8_rows:  # the FP8 linears: the same kernel, FP8 weights
        # the smallest and largest token tile; scales read as words (the real shapes) or as bytes
        for block_t, partial, words in ((16, True, True), (bound, True, True), (bound, False, True),
                                        (bound, True, False)):
            fitted = triton_decode_mm.fit_shared_memory(cfg, 1, block_t)  # as at run time: FP8 weights, this tile
            words = words and fitted.block_k % 128 == 0  # (``scale_words``: whole words per step)
            types = {**decode, "w_ptr": "*u8", "s_ptr": "*u8", "w2_ptr": "*u8", "s2_ptr": "*u8",
                     "out_ptr": "*fp32" if partial else "*bf16"}
            check(f"fp8_decode_mm tokens={block_t} partial={partial} scale_words={words} {fitted}",
                  triton_decode_mm._decode_mm_kernel, types,
                  {"B_FMT": 0, "BLOCK_T": block_t, "BLOCK_W": fitted.block_w, "BLOCK_K": fitted.block_k, "EVEN_K": True,
                   "SCALE_WORDS": words, "PARTIAL": partial, "OUT_F32": False, "ROUND_TRIP": False, "LINE": 128,
                   "FETCH_LINES": triton_decode_mm.fetch_lines(fitted, 1), "EXACT_DOT": False}, fitted,
                  aligned=decode_aligned, spill_free=True, inspect=scales_copied_ahead if words else copied_ahead,
                  pdl=partial and words, prefetch=True)
    def streamed_by_tma(kernel) -> list[str]:
        return [] if "UTMALDG" in kernel.asm["sass"] else ["no tensor-memory-accelerator load"]

    # the tables' configs (by M, with the token counts each takes; by a launch's shape, up to its bound) and
    # the one of weights the accelerator cannot stream (any token count)
    gemv_configs, fewer = {}, 0
    for bound, cfg in tile_configs._GEMV_TABLE:
        gemv_configs.setdefault(cfg, set()).update(range(fewer + 1, min(bound, triton_gemv.MAX_TOKENS) + 1))
        fewer = bound
    for launch_rows in tile_configs._GEMV_BY_SHAPE.values():
        for bound, cfg in launch_rows:
            gemv_configs.setdefault(cfg, set()).update(range(1, min(bound, triton_gemv.MAX_TOKENS) + 1))
    gemv_configs.setdefault(tile_configs.GEMV_IN_REGISTERS, set()).update(range(1, triton_gemv.MAX_TOKENS + 1))
    # (quantize, partial, pdl): the FP8 linears, then wo_a
    one_token = [(True, True, False), (True, False, False), (False, True, False), (True, True, True), (False, False, True)]
    more_tokens = [(True, True, False), (True, False, False), (False, True, True)]
    for cfg, token_counts in gemv_configs.items():
        ring = cfg.num_stages if cfg.num_stages > 1 else 0
        weight = f"tensordesc<i32[{cfg.block_w}, {cfg.block_k // 4}]>" if ring else "*u8"
        variants = [(tokens, *flags) for tokens in sorted(token_counts)
                    for flags in (one_token if tokens == 1 else more_tokens)]
        for tokens, quantize, partial, pdl in variants:
            check(f"fp8_gemv tokens={tokens} quantize={quantize} partial={partial} {cfg}",
                  triton_gemv._fp8_gemv_kernel,
                  {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "w2_ptr": "*u8", "s2_ptr": "*u8",
                   "w_desc": weight, "w2_desc": weight, "out_ptr": "*bf16", "part_ptr": "*fp32",
                   "counter_ptr": "*i32", **scalars("N N2 K k_per_split splits stride_os stride_x width")},
                  {"TOKENS": tokens, "BLOCK_W": cfg.block_w, "BLOCK_K": cfg.block_k, "RING": ring,
                   "QUANTIZE": quantize, "PARTIAL": partial, "INTERPRETED": False}, cfg, wgmma=False,
                  aligned=("x_ptr", "w_ptr", "s_ptr", "w2_ptr", "s2_ptr", "out_ptr", "part_ptr", "K", "k_per_split",
                           "stride_os", "stride_x", "width"),
                  spill_free=True, pdl=pdl, prefetch=True, inspect=streamed_by_tma if ring else None)
    experts_cfg = tile_configs._MMA_EXPERTS_TABLE[0][1]
    for cfg in (experts_cfg, replace(experts_cfg, num_warps=1)):  # (the check ignores types a kernel lacks)
        experts_sizes = {"D": 5120, "INTER": 2304, "WARPS": cfg.num_warps, "INTERPRETED": False}
        experts_types = {"x_ptr": "*bf16", "pair_weight_ptr": "*fp32", "h_ptr": "*bf16", "out_ptr": "*bf16",
                         "part_ptr": "*fp32", "counter_ptr": "*i32", "limit": "fp32", **index, **weights,
                         **scalars("P E stride_we stride_se steps_per_split splits")}
        lanes = register_fed(cfg.num_warps, "HMMA.16816.F32.BF16")
        for pdl, unsorted in ((False, True), (True, False), (True, True)):  # (unsorted: a one-token step)
            experts_sizes["UNSORTED"] = unsorted
            check(f"mma_experts gate_up unsorted={unsorted} {cfg}", triton_mma_experts._gate_up_kernel, experts_types,
                  experts_sizes, cfg, wgmma=False, spill_free=True, inspect=lanes, pdl=pdl, prefetch=unsorted,
                  aligned=("x_ptr", "h_ptr", "part_ptr", "w1_ptr", "s1_ptr", "w3_ptr", "s3_ptr", "stride_we",
                           "stride_se"))
            for partial in (False, True):
                check(f"mma_experts down partial={partial} unsorted={unsorted} {cfg}", triton_mma_experts._down_kernel,
                      experts_types, {**experts_sizes, "PARTIAL": partial}, cfg, wgmma=False, spill_free=True,
                      inspect=lanes, pdl=pdl, prefetch=unsorted,
                      aligned=("h_ptr", "out_ptr", "part_ptr", "w2_ptr", "s2_ptr", "stride_we", "stride_se"))
    for same in (False, True):
        check(f"greedy chunk same={same}", triton_greedy._chunk_kernel,
              {"raw_ptr": "*fp32", "processed_ptr": "*fp32", "part_ptr": "*fp32",
               **scalars("V stride_raw stride_processed chunks")},
              {"CHUNK": triton_greedy.CHUNK, "SAME": same, "INTERPRETED": False}, wgmma=False,
              options={"num_warps": 8})
    check("greedy join", triton_greedy._join_kernel,
          {"part_ptr": "*fp32", "lse_ptr": "*fp32", "token_ptr": "*i64", "chunks": "i32"},
          {"BLOCK": 32, "INTERPRETED": False}, wgmma=False, options={"num_warps": 1})
    for out_f32, round_trip in ((False, False), (True, False), (False, True)):
        check(f"sum_splits out_f32={out_f32} round_trip={round_trip}", triton_decode_mm._sum_splits_kernel,
              {"part_ptr": "*fp32", "out_ptr": "*fp32" if out_f32 else "*bf16", "numel": "i32"},
              {"SPLITS": 4, "OUT_F32": out_f32, "ROUND_TRIP": round_trip, "BLOCK": 1024, "EXACT_DOT": False},
              wgmma=False, spill_free=True, pdl=not out_f32)

    attention = triton_sparse_attention
    sizes = "H D L split_len stride_qt stride_qh stride_pool stride_it stride_vt stride_ot stride_oh"
    for head_dim, narrow, split in ((512, False, False), (512, True, False), (512, True, True), (64, False, False)):
        # V4.1-Flash (both layouts, and a few rows' splits); the tiny models
        block_h, block_d, warps = attention.launch_config(64, head_dim, narrow)
        types = {"q_ptr": "*bf16", "pool_ptr": "*bf16", "index_ptr": "*i64", "valid_ptr": "*u8", "sink_ptr": "*fp32",
                 "out_ptr": "*fp32" if split else "*bf16", "max_ptr": "*fp32", "sum_ptr": "*fp32", "scale": "fp32",
                 **scalars(sizes)}
        # At 64 heads of 512 the output accumulator takes 128 registers per thread and the compiler keeps
        # some addressing in local memory: measured faster than every spill-free layout (the kernel's
        # docstring), so only the narrower width is held spill-free.
        check(f"sparse_attention D={head_dim} heads/program={block_h} split={split}",
              attention._sparse_attention_kernel, types,
              {"BLOCK_H": block_h, "BLOCK_D": block_d, "BLOCK_L": attention.BLOCK_L,
               "EMPTY_MAX": attention.EMPTY_MAX, "SPLIT": split, "INTERPRETED": False},
              options={"num_warps": warps, "num_stages": attention.NUM_STAGES, "enable_fp_fusion": False},
              aligned=("q_ptr", "pool_ptr", "index_ptr", "valid_ptr", "sink_ptr", "out_ptr", "max_ptr", "sum_ptr",
                       *sizes.split()),
              spill_free=head_dim < 512 or narrow, wgmma=block_h >= 64)
    for rope_dims in (0, 64):  # the output rotated back in the combining launch, or not
        check(f"sparse_attention combine_splits rope={rope_dims}", attention._combine_splits_kernel,
              {"acc_ptr": "*fp32", "max_ptr": "*fp32", "sum_ptr": "*fp32", "sink_ptr": "*fp32", "out_ptr": "*bf16",
               "pos_ptr": "*i64", "table_ptr": "*fp32", **scalars("H D SPLITS stride_ot stride_oh stride_p")},
              {"BLOCK_D": 512, "EMPTY_MAX": attention.EMPTY_MAX, "ROPE_DIMS": rope_dims, "INTERPRETED": False},
              options={"num_warps": 4, "enable_fp_fusion": False}, wgmma=False, spill_free=True)

    outputs = ("sorted_ptr", "start_ptr", "count_ptr", "block_expert_ptr", "block_index_ptr")
    for pdl, zero in ((False, False), (True, True)):
        check(f"align_pairs E=384 zero_rows={zero}", triton_align_pairs._align_pairs_kernel,
              {"expert_ptr": "*i64", **{name: "*i64" for name in outputs}, "zero_ptr": "*bf16",
               **scalars("P E NB block_m D")},
              {"BINS": 512, "CHUNK": triton_align_pairs.CHUNK, "BLOCK_CHUNK": triton_align_pairs.BLOCK_CHUNK,
               "ZERO": zero}, wgmma=False, pdl=pdl)

    hash_fn = triton_ngram_hash._ngram_hash_kernel
    check("ngram_hash layers=2 n=3 heads=8", hash_fn,
          {**{name: "*i64" for name in hash_fn.arg_names if name.endswith("_ptr")}, **scalars("T keep stride_hist"),
           "pad_id": "i64"},
          {"LAYERS": 2, "NGRAM": 3, "HEADS": 8, "LAYERS_P": 2, "HEADS_P": 8, "BLOCK_T": triton_ngram_hash.BLOCK_T},
          wgmma=False)

    pointers = ("part_ptr", "scale_ptr", "base_ptr", "pre_ptr", "post_ptr", "comb_ptr")
    check("split_sinkhorn hc=4", triton_sinkhorn._sinkhorn_kernel,
          {**{name: "*fp32" for name in pointers}, **scalars("T stride_pt iters K"), "eps": "fp32",
           "norm_eps": "fp32"},
          {"HC": 4, "BLOCK_T": triton_sinkhorn.BLOCK_T, "SLICES": 40, "COLS": triton_hc_coefficients.PARTIAL_COLS,
           "INTERPRETED": False},
          options={"num_warps": triton_sinkhorn.NUM_WARPS, "enable_fp_fusion": False}, wgmma=False)
    # rows held in registers up to 16384 entries (2075 and 8216 with a tail tile), re-read beyond; the
    # pointers 16-byte aligned as torch allocates them (the compiler then loads whole chunks)
    for width in (300, 2075, 8192, 8216, 16384, 32768):
        block, tail, warps, in_registers = triton_top_entries.block_size(width, shift_free=width % 8 == 0)
        check(f"top_entries width={width}", triton_top_entries._top_entries_kernel,
              {"scores_ptr": "*i16", "k_ptr": "*i64", "out_ptr": "*i64", **scalars("E K_MAX stride_s stride_o")},
              {"BLOCK": block, "TAIL": tail, "IN_REGISTERS": in_registers, "K_BLOCK": 512},
              options={"num_warps": warps}, wgmma=False, spill_free=True, aligned=("scores_ptr", "out_ptr"))
    check("hc mix partials", triton_hc_coefficients._mix_partials_kernel,
          {"x_ptr": "*bf16", "fn_ptr": "*fp32", "part_ptr": "*fp32", **scalars("T K stride_x stride_fn stride_pt")},
          {"MIXES": 24, "COLS": triton_hc_coefficients.PARTIAL_COLS, "BLOCK_T": triton_hc_coefficients.BLOCK_T,
           "BLOCK_K": triton_hc_coefficients.BLOCK_K, "SPLIT_K": triton_hc_coefficients.SPLIT_K,
           "INTERPRETED": False}, spill_free=True)
    for group, e4m3_scale, block_k in ((32, False, 128), (16, True, 512)):  # index keys/queries; compressed KV
        for rope_dims in (0, 64):
            check(f"fp4_round_trip group={group} rope={rope_dims}", triton_fp4_round_trip._fp4_round_trip_kernel,
                  {"x_ptr": "*i16", "out_ptr": "*bf16", "pos_ptr": "*i64", "table_ptr": "*fp32",
                   **scalars("R K stride_x stride_o stride_p rows_per_position")},
                  {"GROUP": group, "E4M3_SCALE": e4m3_scale,
                   "BLOCK_ROWS": triton_fp4_round_trip.BLOCK_ELEMENTS // block_k, "BLOCK_K": block_k,
                   "ROPE_DIMS": rope_dims, "INTERPRETED": False}, wgmma=False)
    norm_outputs = {triton_rms_norm.PLAIN: "plain", triton_rms_norm.ROUND_TRIP: "round trip", triton_rms_norm.BOTH: "both"}
    for out_bf16, block_d, pdl, outputs in ((True, 8192, False, triton_rms_norm.PLAIN),
                                            (True, 512, False, triton_rms_norm.PLAIN),
                                            (False, 128, False, triton_rms_norm.PLAIN),
                                            (True, 8192, True, triton_rms_norm.PLAIN),
                                            (True, 2048, False, triton_rms_norm.ROUND_TRIP)):  # q_norm
        dtype = "*bf16" if out_bf16 else "*fp32"
        check(f"rms_norm bf16={out_bf16} D<={block_d} {norm_outputs[outputs]}", triton_rms_norm._rms_norm_kernel,
              {"x_ptr": dtype, "w_ptr": "*bf16", "out_ptr": dtype, "out2_ptr": dtype,
               **scalars("D stride_x stride_o stride_o2"), "inv_d": "fp32", "eps": "fp32"},
              {"BLOCK_D": block_d, "OUT_BF16": out_bf16, "OUTPUTS": outputs, "INTERPRETED": False},
              options={"num_warps": triton_rms_norm.row_warps(block_d), "enable_fp_fusion": False},  # the launcher's
              wgmma=False, pdl=pdl, spill_free=True, prefetch=True)  # (the norm's weight)
    for pdl, outputs in ((False, triton_rms_norm.PLAIN), (True, triton_rms_norm.BOTH)):  # the final norm; a sub-layer's
        check(f"sublayer_input D<=8192 hc=4 {norm_outputs[outputs]}", triton_sublayer_input._sublayer_input_kernel,
              {"stream_ptr": "*bf16", "pre_ptr": "*fp32", "w_ptr": "*bf16", "out_ptr": "*bf16", "out2_ptr": "*bf16",
               **scalars("D stride_st stride_sh stride_p stride_o stride_o2"), "inv_d": "fp32", "eps": "fp32"},
              {"HC": 4, "BLOCK_D": 8192, "OUTPUTS": outputs, "INTERPRETED": False},
              options={"num_warps": triton_rms_norm.row_warps(8192), "enable_fp_fusion": False},
              wgmma=False, pdl=pdl, spill_free=True, prefetch=True)
    for ring in (False, True):  # a decode step's rows stored in the window's ring by the same launch
        check(f"window_kv D=512 R=64 ring={ring}", triton_window_kv._window_kv_kernel,
              {"x_ptr": "*bf16", "w_ptr": "*bf16", "pos_ptr": "*i64", "table_ptr": "*fp32", "out_ptr": "*bf16",
               "ring_ptr": "*u8" if ring else "*bf16", "ring_rows_ptr": "*i64" if ring else "*bf16",
               **scalars("D stride_x stride_o stride_p"), "inv_d": "fp32", "eps": "fp32"},
              {"BLOCK_D": 512, "HALF": 32, "RING": ring, "UE8M0": ring, "INTERPRETED": False},
              options={"num_warps": 1, "enable_fp_fusion": False}, wgmma=False, spill_free=True)
    for inverse in (False, True):
        check(f"rope inverse={inverse}", triton_rope._rope_kernel,
              {"x_ptr": "*bf16", "pos_ptr": "*i64", "table_ptr": "*fp32", **scalars("H stride_xt stride_xh stride_p")},
              {"HALF": 32, "INVERSE": inverse, "BLOCK_H": triton_rope.BLOCK_H, "INTERPRETED": False},
              options={"num_warps": triton_rope.NUM_WARPS, "enable_fp_fusion": False}, wgmma=False)
    mix = {"HC": 4, "BLOCK_D": triton_mhc.BLOCK_D, "INTERPRETED": False}
    check("hc_collapse", triton_mhc._collapse_kernel,
          {"stream_ptr": "*bf16", "pre_ptr": "*fp32", "out_ptr": "*bf16", **scalars("D stride_st stride_sh stride_pt "
                                                                                   "stride_ot")},
          mix, options={"enable_fp_fusion": False}, wgmma=False)
    check("hc_expand", triton_mhc._expand_kernel,
          {"output_ptr": "*bf16", "residual_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32", "y_ptr": "*bf16",
           **scalars("D stride_ot stride_rt stride_rh stride_yt stride_yh")},
          mix, options={"enable_fp_fusion": False}, wgmma=False)
    check("index_scores H=64 d=128", triton_index_scores._index_scores_kernel,
          {"q_ptr": "*bf16", "w_ptr": "*bf16", "k_ptr": "*bf16", "seq_ptr": "*i64", "out_ptr": "*bf16",
           **scalars("E stride_qt stride_qh stride_wt stride_kb stride_ke stride_ot")},
          {"H": 64, "D": 128, "BLOCK_E": triton_index_scores.BLOCK_E, "INTERPRETED": False},
          options={"num_warps": 4, "enable_fp_fusion": False}, spill_free=True)
    not_paged = ("i32",) * len(triton_cache_codec._NOT_PAGED)
    paged = ("*i64", "i32", "i32", "*i64", "i32", "i32", "*i64", "i32", "i32", "i32", "i32", "i32")  # _data_rows
    for (fmt, width), rows, pages in itertools.product(((WINDOW_KV, 512), (COMPRESSED_KV, 512), (INDEX_KEYS, 128)),
                                                       (1, None), (not_paged, paged)):  # one row (decode), full
        constants = {**triton_cache_codec._constants(fmt, width, rows), "PAGED": pages is paged}
        label = f"{fmt.describe()} rows={rows}{' paged' if pages is paged else ''}"
        check(f"cache read {label}", triton_cache_codec._read_rows_kernel,
              {"data_ptr": "*u8", "rows_ptr": "*i64", "out_ptr": "*i16", "M": "i32", "pages": pages}, constants,
              wgmma=False)
        check(f"cache write {label}", triton_cache_codec._write_rows_kernel,
              {"values_ptr": "*i16", "rows_ptr": "*i64", "data_ptr": "*u8", "M": "i32", "stride_v": "i32",
               "pages": pages}, constants, wgmma=False)
    for clamp, pdl, round_trip in ((True, False, False), (False, False, False), (True, True, False), (True, False, True)):
        check(f"swiglu clamp={clamp} round_trip={round_trip}", triton_moe_sum._swiglu_kernel,
              {"gate_ptr": "*bf16", "up_ptr": "*bf16", "out_ptr": "*bf16", **scalars("I stride_g stride_u stride_o"),
               "limit": "fp32"},
              {"CLAMP": clamp, "ROUND_TRIP": round_trip, "BLOCK": triton_moe_sum.BLOCK, "INTERPRETED": False},
              options={"enable_fp_fusion": False}, wgmma=False, pdl=pdl, spill_free=True)
    check("engram_gate hc=4", triton_engram._engram_gate_kernel,
          {"h_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*bf16",
           **scalars("D stride_k stride_v"), "eps": "fp32", "clamp": "fp32", "inv_sqrt_d": "fp32"},
          {"HC": 4, "BLOCK": triton_engram.BLOCK, "INTERPRETED": False}, options={"enable_fp_fusion": False},
          wgmma=False)
    check("moe_sum k=6", triton_moe_sum._moe_sum_kernel,
          {"routed_ptr": "*bf16", "ids_ptr": "*i64", "shared_ptr": "*bf16", "out_ptr": "*bf16",
           **scalars("D stride_rt stride_rk stride_it stride_st stride_ot")},
          {"K": 6, "K_POW2": 8, "BLOCK": triton_moe_sum.BLOCK, "INTERPRETED": False},
          options={"enable_fp_fusion": False}, wgmma=False)
    check("join_lists", triton_join_lists._join_lists_kernel,
          {"window_index_ptr": "*i64", "window_valid_ptr": "*u8", "window_width_ptr": "*i64",
           "compressed_index_ptr": "*i64", "compressed_count_ptr": "*i64", "compressed_width_ptr": "*i64",
           "index_ptr": "*i64", "valid_ptr": "*u8", "length_ptr": "*i64", **scalars("W K stride_wi stride_wv stride_ci")},
          {"BLOCK": triton_join_lists.BLOCK}, wgmma=False)
    check("route k=6 experts=384", triton_route._route_kernel,
          {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i64",
           **scalars("E stride_l stride_w stride_i"), "temperature": "fp32", "route_scale": "fp32"},
          {"K": 6, "K_POW2": 8, "BLOCK_E": 512, "NORMALIZE": True, "INTERPRETED": False},
          options={"enable_fp_fusion": False}, wgmma=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
