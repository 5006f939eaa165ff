"""EP buffer layout and size-hint arithmetic (no processes, no GPU)."""
import pytest
import torch

from llcomm.ep import EPBuffer
from llcomm.ep.layout import (ALIGN, DEFAULT_NUM_BLOCKS, MAX_TOPK, MAX_WAIT_FLAGS, NUM_SETS,
                              SIGNAL_PHASES, deepep_low_latency_size_hint, ep_layout)

SHAPES = [  # (tokens, hidden, ranks, experts)
    (128, 7168, 2, 256), (256, 7168, 8, 256), (128, 4096, 8, 128), (1, 2048, 2, 128),
    (512, 7168, 2, 256), (64, 2880, 4, 128), (7, 16, 3, 9),
]


@pytest.mark.parametrize("T,H,W,E", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_regions_disjoint_aligned_and_sized(T, H, W, E, dtype):
    isz = torch.tensor([], dtype=dtype).element_size()
    lay = ep_layout(T, H, W, E, isz, num_blocks=DEFAULT_NUM_BLOCKS)
    L = E // W
    need = {"signal": 8 * SIGNAL_PHASES * DEFAULT_NUM_BLOCKS * W, "recv_x": W * T * H * isz,
            "recv_meta": 8 * W * T * MAX_TOPK, "recv_count": 8 * W * L, "recv_ntok": 8 * W,
            "combine_x": W * T * H * isz, "combine_weights": 4 * W * T * MAX_TOPK,
            "dispatch_weights": 4 * W * T * MAX_TOPK, "recv_weights": 8 * W * T * MAX_TOPK}
    spans = []
    for k, s in enumerate(lay.sets):
        assert s.base == k * lay.set_bytes and s.end == (k + 1) * lay.set_bytes
        for name, size in need.items():
            off = getattr(s, name)
            assert off % ALIGN == 0, name
            assert off - s.base == lay.offsets()[name], name
            spans.append((off, off + size, f"set{k}.{name}"))
    spans.sort()
    for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
        assert a1 <= b0, f"{an} overlaps {bn}"
    assert spans[-1][1] <= lay.total_bytes == NUM_SETS * lay.set_bytes
    assert lay.total_bytes % ALIGN == 0
    assert lay.total_bytes - sum(b - a for a, b, _ in spans) < len(spans) * ALIGN


def test_fewer_blocks_same_bytes_and_too_many_refused():
    """A GPU with fewer SMs launches fewer blocks but needs what size_hint says; a wait polls
    at most MAX_WAIT_FLAGS flags."""
    sizes = {ep_layout(128, 7168, 2, 256, 2, num_blocks=nb).total_bytes
             for nb in (1, 64, DEFAULT_NUM_BLOCKS)}
    assert sizes == {EPBuffer.size_hint(128, 7168, 2, 256, torch.bfloat16)}
    with pytest.raises(ValueError, match="flags a wait polls"):
        ep_layout(128, 7168, 8, 256, 2, num_blocks=MAX_WAIT_FLAGS // 8 + 1)


@pytest.mark.parametrize("T,H,W,E", SHAPES)
def test_size_hint_is_the_layout_and_below_deepep(T, H, W, E):
    hint = EPBuffer.size_hint(T, H, W, E, torch.bfloat16)
    assert hint == ep_layout(T, H, W, E, 2).total_bytes
    if E % 128 == 0 and H % 128 == 0:
        assert hint <= deepep_low_latency_size_hint(T, H, W, E)


def test_deepseek_shape_numbers():
    # The anchor: DeepEP asks about 1.8 GiB at 128 tokens, hidden 7168, 256 experts.
    deepep = deepep_low_latency_size_hint(128, 7168, 2, 256)
    assert 1.7 * 2**30 < deepep < 1.8 * 2**30          # 1,908 MB: DeepEP's hint for these arguments
    ours = EPBuffer.size_hint(128, 7168, 2, 256, torch.bfloat16)
    # two sets x (dispatch + combine receive) x 2 ranks x 128 tokens x 14 KiB, plus metadata
    assert 4 * 2 * 128 * 7168 * 2 <= ours < 4 * 2 * 128 * 7168 * 2 + (1 << 20)
    assert ours * 100 < deepep


def test_size_hint_refuses_bad_arguments():
    with pytest.raises(ValueError, match="not a multiple of the number of ranks"):
        EPBuffer.size_hint(128, 7168, 3, 256, torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        EPBuffer.size_hint(128, 7164, 2, 256, torch.bfloat16)
    with pytest.raises(ValueError, match="at most 65536"):
        EPBuffer.size_hint(1 << 17, 128, 2, 256, torch.bfloat16)
    with pytest.raises(ValueError, match="hidden=0"):
        EPBuffer.size_hint(128, 0, 2, 256, torch.bfloat16)
    with pytest.raises(TypeError, match="dtype"):
        EPBuffer.size_hint(128, 7168, 2, 256, torch.int32)


def test_num_blocks_env_reaches_both(monkeypatch):
    base = EPBuffer.size_hint(16, 64, 2, 8, torch.bfloat16)
    monkeypatch.setenv("LLCOMM_EP_NUM_BLOCKS", "32")
    smaller = EPBuffer.size_hint(16, 64, 2, 8, torch.bfloat16)
    assert smaller == ep_layout(16, 64, 2, 8, 2, num_blocks=32).total_bytes
    assert smaller <= base
    monkeypatch.setenv("LLCOMM_EP_NUM_BLOCKS", "many")
    with pytest.raises(ValueError, match="LLCOMM_EP_NUM_BLOCKS"):
        EPBuffer.size_hint(16, 64, 2, 8, torch.bfloat16)


@pytest.mark.parametrize("T,H,W,E", [s for s in SHAPES if s[1] % 128 == 0])
def test_fp8_layout(T, H, W, E):
    """FP8-only buffers are smaller; every buffer's dispatch region holds FP8 rows and scales."""
    from llcomm.ep.layout import fp8_dispatch_bytes
    bf16 = ep_layout(T, H, W, E, 2, num_blocks=64)
    f8 = ep_layout(T, H, W, E, 2, num_blocks=64, fp8=True)
    assert EPBuffer.size_hint(T, H, W, E, torch.bfloat16, fp8=True) == f8.total_bytes
    assert f8.total_bytes < bf16.total_bytes
    for lay in (bf16, f8):
        o = lay.offsets()
        assert o["recv_scales"] % 16 == 0
        assert o["recv_scales"] + W * T * (H // 128) * 4 <= o["recv_meta"]
        assert o["recv_meta"] - o["recv_x"] >= fp8_dispatch_bytes(W, T, H)
    # saving per set: bf16 rows minus FP8 rows and scales, within alignment
    saved = bf16.set_bytes - f8.set_bytes
    assert abs(saved - (W * T * H * 2 - fp8_dispatch_bytes(W, T, H))) < 2 * ALIGN
    if (T, H, W, E) == (128, 7168, 2, 256):       # the numbers docs/ep.md quotes
        assert 0.75 < f8.total_bytes / bf16.total_bytes < 0.77


def test_fp8_size_hint_refusals():
    with pytest.raises(ValueError, match="hidden=64 with fp8=True"):
        EPBuffer.size_hint(128, 64, 2, 256, torch.bfloat16, fp8=True)
    with pytest.raises(TypeError, match="fp8"):
        EPBuffer.size_hint(128, 128, 2, 256, torch.bfloat16, fp8="yes")


def test_kernels_take_the_declared_parameters():
    """Both dispatch kernels take DISPATCH_ARGS, in that order, then the same constexpr
    bundles; kernel_consts gives every constexpr each kernel has no default for (the flag
    dispatch's wait polls every block's flag of every rank)."""
    import inspect
    from llcomm.ep import kernels as K
    from llcomm.ep.peer import dispatch_kernel, kernel_consts
    lay = ep_layout(128, 7168, 2, 256, 2, num_blocks=DEFAULT_NUM_BLOCKS)
    for ll in (0, 1):
        fn = dispatch_kernel(ll)
        names = list(fn.arg_names)
        assert tuple(names[:len(K.DISPATCH_ARGS)]) == K.DISPATCH_ARGS, fn
        d, c, _ = kernel_consts(lay, 8, ll=ll)
        for kern, consts in ((fn, d), (K.combine_kernel, c)):
            params = inspect.signature(kern.fn).parameters
            need = {n for n, p in params.items() if n.isupper() and p.default is p.empty}
            assert need - {"STAGES", "FP8"} <= set(consts) <= set(params), (kern, ll)
        assert d["TILING"].FLAGS_P2 == 2 * DEFAULT_NUM_BLOCKS
        assert isinstance(d["SIZES"], K.Sizes) and d["SIZES"] == c["SIZES"]


def test_dispatch_choice_and_tiles(monkeypatch):
    """Defaults: the LL dispatch up to LL_MAX_TOKENS, the flag dispatch above (LLCOMM_EP_LL
    forces either, and refuses a bad value by name); one 128-token scan tile (fewer tokens per
    tile when a block owns more experts) and a 16-token one for small sends."""
    from llcomm.ep.peer import LL_MAX_TOKENS, kernel_consts, ll_dispatch
    from llcomm.runtime.settings import EPSettings
    LL_ENV = "LLCOMM_EP_LL"

    def _ll(max_tokens):
        return ll_dispatch(EPSettings.read(), max_tokens)
    lay = ep_layout(128, 7168, 2, 256, 2, num_blocks=DEFAULT_NUM_BLOCKS)
    d, _, _ = kernel_consts(lay, 8)
    assert _ll(128) == 1 and "MASKS" not in d     # the LL kernel's
    assert (d["TILING"].SCAN_TILE, d["TILING"].SMALL_SCAN_TILE) == (128, 16)
    assert (d["ROW"].WORDS, d["ROW"].SCALES) == (7168 * 2 // 4, 7168 // 128)
    big = ep_layout(512, 7168, 2, 256, 2, num_blocks=DEFAULT_NUM_BLOCKS)
    assert _ll(512) == 0 and "MASKS" in kernel_consts(big, 8)[0]   # the flag kernel's
    assert _ll(LL_MAX_TOKENS) == 1
    for v in ("0", "1"):        # forced either way, whatever the buffer
        monkeypatch.setenv(LL_ENV, v)
        assert _ll(128) == _ll(512) == int(v)
        assert ["MASKS" not in kernel_consts(b, 8)[0] for b in (lay, big)] == [v == "1"] * 2
    monkeypatch.setenv(LL_ENV, "yes")
    with pytest.raises(ValueError, match=LL_ENV):
        kernel_consts(lay, 8)
    monkeypatch.delenv(LL_ENV)
    assert kernel_consts(big, 8)[0]["TILING"].SCAN_TILE == 128    # tokens x top-k x experts
    many = ep_layout(128, 7168, 2, 4096, 2, num_blocks=DEFAULT_NUM_BLOCKS)
    assert kernel_consts(many, 8)[0]["TILING"].SCAN_TILE * 8 * 32 <= 8192
    tiling = kernel_consts(lay, 8, tile_tokens=8)[0]["TILING"]     # the small tile: at most it
    assert (tiling.SCAN_TILE, tiling.SMALL_SCAN_TILE) == (8, 8)


def test_size_hint_across_hosts():
    """``size_hint(num_ranks_per_host=R)`` is the two-level region the SHMEM kernels allocate
    (the layout they index: every part inside it, none overlapping); R = num_ranks is one host
    (the single-host region); R not a divisor is refused."""
    import llcomm
    from llcomm.ep.hosts.peer import default_num_blocks, make_layout
    got = llcomm.EPBuffer.size_hint(128, 7168, 16, 256, num_ranks_per_host=8)
    lay = make_layout(128, 7168, 2, 8, 2, False, 256, default_num_blocks(2, 8))
    assert got == lay.total_bytes == 2 * lay.set_bytes
    spans = sorted(lay.offsets.items(), key=lambda kv: kv[1])
    assert spans[0][1] == 0 and all(b[1] > a[1] for a, b in zip(spans, spans[1:]))
    assert lay.offsets["c_back"] + 2 * 128 * 7168 * 2 <= lay.set_bytes
    fp8 = llcomm.EPBuffer.size_hint(128, 7168, 16, 256, fp8=True, num_ranks_per_host=8)
    assert fp8 < got
    assert llcomm.EPBuffer.size_hint(64, 1024, 2, 8, num_ranks_per_host=2) == \
        llcomm.EPBuffer.size_hint(64, 1024, 2, 8)
    with pytest.raises(ValueError, match="num_ranks_per_host=3; expected a divisor of "
                                         "num_ranks=16"):
        llcomm.EPBuffer.size_hint(128, 7168, 16, 256, num_ranks_per_host=3)
