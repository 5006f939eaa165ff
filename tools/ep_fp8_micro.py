"""How long one block takes to quantise one token row to FP8 and issue its stores, per variant
(one GPU, no peers): the LL dispatch's send stage without the NVLink part.

    python tools/ep_fp8_micro.py [--hidden 7168] [--rows 128] [--reps 200] [--llcomm DIR]

Every block quantises row ``program_id`` (the dispatch at 128 tokens: one row per block) and
stores the words locally; each block stamps its SM cycle counter before its load and after its
last store is issued. Prints the median over blocks and repetitions, in cycles and in µs at the
SM clock the run measured (cycles of a timed 1 ms spin). Variants: ``copy`` (the bf16 row as
int32 words: the bf16 dispatch's send), ``fp8-rcp`` (llcomm/ep/kernels/fp8.py ``_pack_row_fp8``,
the LL dispatch's quantiser: divisions by the refined reciprocal ``_div_by``, the hardware
convert), ``scales`` (the row's load and its scales only: what the rest of ``fp8-rcp`` adds to
it). Checks that the FP8 variants wrote the same bytes as torch's reference
(llcomm/ep/fp8.py) and prints the number of words that differ. ``--llcomm DIR`` times the
kernels of another checkout's llcomm package (an A/B in one call).
"""

import torch
import triton
import triton.language as tl

from _checkout import argument_parser, use_llcomm_dir  # noqa: E402  (tools/, beside this file)

use_llcomm_dir()

from llcomm.ep import fp8 as ep_fp8  # noqa: E402
from llcomm.ep.kernels.common import _row_words  # noqa: E402
from llcomm.ep.kernels.fp8 import FP8_BLOCK, _fp8_scales, _pack_row_fp8  # noqa: E402
from llcomm.runtime.kernels.sync import sm_cycles  # noqa: E402


@triton.jit
def _micro(x, outw, outs, stamps, H: tl.constexpr, HP: tl.constexpr, RW: tl.constexpr,
           HPW: tl.constexpr, NS: tl.constexpr, MODE: tl.constexpr):
    t = tl.program_id(0)
    c0 = sm_cycles()
    ws = tl.arange(0, HPW)
    if MODE == 0:
        words = _row_words(tl.load(x.to(tl.pointer_type(tl.int32)) + t * RW + ws, mask=ws < RW))
        tl.store(outw + t * RW + ws, words, mask=ws < RW)
    elif MODE == 4:
        hs = tl.arange(0, HP)
        v = tl.load(x + t * H + hs, mask=hs < H, other=0.0).to(tl.float32)
        sc = _fp8_scales(tl.reshape(v, (HP // FP8_BLOCK, FP8_BLOCK)), 0)
        ns = tl.arange(0, HP // FP8_BLOCK)
        tl.store(outs + t * NS + ns, sc.to(tl.int32, bitcast=True), mask=ns < NS)
    else:
        hs = tl.arange(0, HP)
        v = tl.load(x + t * H + hs, mask=hs < H, other=0.0).to(tl.float32)
        words, sw = _pack_row_fp8(v, HP, HPW, 0)
        ns = tl.arange(0, HP // FP8_BLOCK)
        tl.store(outw + t * RW + ws, words, mask=ws < RW)
        tl.store(outs + t * NS + ns, sw, mask=ns < NS)
    c1 = sm_cycles()
    tl.store(stamps + t, c1 - c0)


@triton.jit
def _spin(out, n):
    c0 = sm_cycles()
    c = c0
    while c - c0 < n:
        c = sm_cycles()
    tl.store(out, c - c0)


def sm_clock_ghz() -> float:
    out = torch.zeros(1, dtype=torch.int64, device="cuda")
    n = 2_000_000
    _spin[(1,)](out, n)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    _spin[(1,)](out, n)
    e.record()
    torch.cuda.synchronize()
    return out.item() / (s.elapsed_time(e) * 1e6)


def main():
    ap = argument_parser()
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    H, n = a.hidden, a.rows
    HP = triton.next_power_of_2(H)
    x = torch.randn(n, H, device="cuda").to(torch.bfloat16)
    ref_q, ref_s = ep_fp8.quantize(x)
    ghz = sm_clock_ghz()
    print(f"# {torch.cuda.get_device_name()}, hidden {H}, {n} rows, SM clock {ghz:.2f} GHz, "
          f"llcomm from {a.llcomm}")
    print(f"{'variant':10s} {'median cycles':>14s} {'µs':>7s} {'p90 µs':>7s}  wrong words")
    for name, mode in (("copy", 0), ("fp8-rcp", 3), ("scales", 4)):
        rw = H * 2 // 4 if mode == 0 else H // 4
        outw = torch.zeros(n, rw, dtype=torch.int32, device="cuda")
        outs = torch.zeros(n, H // FP8_BLOCK, dtype=torch.int32, device="cuda")
        stamps = torch.zeros(n, dtype=torch.int64, device="cuda")
        got = []
        for _ in range(a.reps):
            _micro[(n,)](x, outw, outs, stamps, H=H, HP=HP, RW=rw,
                         HPW=triton.next_power_of_2(rw), NS=H // FP8_BLOCK, MODE=mode,
                         num_warps=8)
            got.append(stamps.clone())
        cyc = torch.cat(got).double()
        med, p90 = cyc.median().item(), cyc.quantile(0.9).item()
        wrong = "-"
        if mode == 4:
            wrong = int((outs.view(torch.float32) != ref_s).sum())
        elif mode:
            q = ref_q.view(torch.uint8).view(n, rw, 4).to(torch.int32)
            want = q[..., 0] | (q[..., 1] << 8) | (q[..., 2] << 16) | (q[..., 3] << 24)
            wrong = int((outw != want).sum()) + int((outs.view(torch.float32) != ref_s).sum())
        print(f"{name:10s} {med:14.0f} {med / ghz / 1e3:7.2f} {p90 / ghz / 1e3:7.2f}  {wrong}")


if __name__ == "__main__":
    main()
