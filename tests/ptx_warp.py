"""A warp's worth of PTX executed lane by lane on the CPU, for the kernels' inline assembly.

The interpreter cannot run inline assembly, so the tests execute the kernels' PTX text for the 32
lanes of a warp: each instruction the kernels use, with its PTX ISA meaning, and the tensor-core
instruction with the fragment layout of the ISA's "Matrix Fragments for mma.m16n8k16 with floating
point type" (groupID = lane >> 2, threadID_in_group = lane % 4), independently of how a kernel chose
its fragments. An instruction it does not know fails the test.
"""

from __future__ import annotations

import re

import numpy as np


def f32(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint32).view(np.float32)[0])


def bits32(value: float) -> int:
    return int(np.array([value], dtype=np.float32).view(np.uint32)[0])


def bf16(bits: int) -> float:
    return f32((bits & 0xFFFF) << 16)


def _bf16_bits(value: float) -> int:
    """fp32 ``value`` rounded to bf16 (to nearest even), as 16 bits."""
    b = bits32(value)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def _prmt(a: int, b: int, selector: int) -> int:
    """``prmt.b32`` in its default mode: byte i of the result is byte ``selector[i] & 7`` of {b, a}
    (a's bytes 0..3), replaced by its sign bit in all 8 bits where ``selector[i] & 8``."""
    source = (b << 32) | a
    out = 0
    for i in range(4):
        sel = (selector >> (4 * i)) & 0xF
        byte = (source >> (8 * (sel & 7))) & 0xFF
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _mma(regs: list[dict], vec: list[list[str]]) -> None:
    """``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`` over the 32 lanes' registers."""
    a_mat, b_mat, c_mat = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    for lane, r in enumerate(regs):
        g, t = lane >> 2, lane % 4
        a_vals = [h for reg in vec[1] for h in (r[reg] & 0xFFFF, r[reg] >> 16)]  # a0..a7, low half first
        for i, h in enumerate(a_vals):
            a_mat[g + 8 * (i % 4 >= 2), 2 * t + (i & 1) + 8 * (i >= 4)] = bf16(h)
        b_vals = [h for reg in vec[2] for h in (r[reg] & 0xFFFF, r[reg] >> 16)]
        for i, h in enumerate(b_vals):
            b_mat[2 * t + (i & 1) + 8 * (i >= 2), g] = bf16(h)
        for i, reg in enumerate(vec[3]):
            c_mat[g + 8 * (i >= 2), 2 * t + (i & 1)] = f32(r[reg])
    d_mat = a_mat @ b_mat + c_mat
    for lane, r in enumerate(regs):
        g, t = lane >> 2, lane % 4
        for i, reg in enumerate(vec[0]):
            r[reg] = bits32(d_mat[g + 8 * (i >= 2), 2 * t + (i & 1)])


def run_warp_ptx(ptx: str, operands: list[list[int]], outputs: int) -> list[list[int]]:
    """Execute ``ptx`` for 32 lanes; ``operands[i][lane]`` is the bit pattern of ``$(outputs + i)``.
    Returns ``[lane][j]``, the bits of ``$j`` for each output j."""
    regs = [{f"${outputs + i}": op[lane] for i, op in enumerate(operands)} for lane in range(32)]
    for raw in re.split(r"[;\n]", ptx):
        line = raw.strip().lstrip("{").strip()  # a block's opening brace may share a line with its first
        if not line or line == "}" or line.startswith(".reg"):
            continue
        opcode, rest = line.split(None, 1)
        args = [a.strip() for a in re.split(r",\s*(?![^{]*})", rest)]
        vec = [[v.strip() for v in a.strip("{}").split(",")] for a in args]
        if opcode == "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32":
            _mma(regs, vec)
            continue
        for r in regs:
            def val(a: str) -> int:
                if a.startswith("0f"):
                    return int(a[2:], 16)
                if a.startswith("0x"):
                    return int(a, 16)
                return int(a) if a.isdigit() else r[a]
            if opcode in ("mov.b64", "mov.b32") and len(vec[0]) == 2:
                width = 32 if opcode == "mov.b64" else 16
                r[vec[0][0]], r[vec[0][1]] = r[args[1]] & ((1 << width) - 1), r[args[1]] >> width
            elif opcode in ("mov.u32", "mov.b32"):
                r[args[0]] = val(args[1])
            elif opcode == "cvt.u32.u16":
                r[args[0]] = val(args[1]) & 0xFFFF
            elif opcode == "prmt.b32":
                r[args[0]] = _prmt(val(args[1]), val(args[2]), val(args[3]))
            elif opcode == "mad.lo.u32":
                r[args[0]] = (val(args[1]) * val(args[2]) + val(args[3])) & 0xFFFFFFFF
            elif opcode == "and.b32":
                r[args[0]] = val(args[1]) & val(args[2])
            elif opcode == "or.b32":
                r[args[0]] = val(args[1]) | val(args[2])
            elif opcode == "shl.b32":
                r[args[0]] = (val(args[1]) << val(args[2])) & 0xFFFFFFFF
            elif opcode == "shr.b32":
                r[args[0]] = (val(args[1]) & 0xFFFFFFFF) >> val(args[2])
            elif opcode == "mul.rn.bf16x2":
                a, b = val(args[1]), val(args[2])
                low = _bf16_bits(bf16(a) * bf16(b))
                high = _bf16_bits(bf16(a >> 16) * bf16(b >> 16))
                r[args[0]] = low | high << 16
            else:
                raise AssertionError(f"the test does not know {opcode}")
    return [[r[f"${j}"] for j in range(outputs)] for r in regs]
