"""llcomm/runtime/protocol.py: size tags, error words and the timeout setting.

Error words are built here from the bit layout documented in protocol.py (status at bit 48, op at
bit 40, phase at bit 32, rank mask in bits 31..0), not with a helper of the module under test.
"""
import pytest

from llcomm.runtime import protocol as P
from llcomm.errors import CommMismatchError, CommTimeoutError, LLCommError

DTYPES = ("bfloat16", "float16", "float32")
#: Element counts the TP joins of a decode step see: tokens x hidden size.
HIDDEN = (1024, 2048, 4096, 5120, 7168, 8192, 12288, 16384)
TOKENS = range(1, 257)


def word(status: int, op: int, phase: int, ranks=()) -> int:
    mask = 0
    for r in ranks:
        mask |= 1 << r
    return (status << 48) | (op << 40) | (phase << 32) | mask


# -- size_tag ----------------------------------------------------------------------------------
@pytest.mark.parametrize("numel", [0, 1, 7, 1000, 4097, (1 << 20) + 3, 1 << 31, (1 << 40) + 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_size_tag_fits_24_bits_and_carries_the_op(numel, dtype):
    for op in P.OPS:
        tag = P.size_tag(op, numel, dtype)
        assert 0 <= tag <= P.TAG_MASK, (op, numel, dtype, tag)
        assert tag >> 16 == op  # bits 23..16: the op code
        # a flag word keeps it intact under any epoch
        assert ((12345 << P.EPOCH_SHIFT) | tag) & P.TAG_MASK == tag


def test_size_tag_differs_by_op():
    for numel in (1, 7, 4096, 8192 * 16, (1 << 20) + 3):
        for dtype in DTYPES:
            tags = [P.size_tag(op, numel, dtype) for op in P.OPS]
            assert len(set(tags)) == len(tags), (numel, dtype)


def test_size_tag_differs_by_dtype():
    names = list(P.DTYPE_CODES)
    for numel in range(1, 20_000):
        tags = {P.size_tag(P.OP_ONE_SHOT, numel, d) for d in names}
        assert len(tags) == len(names), numel


@pytest.mark.parametrize("dtype", DTYPES)
def test_size_tag_differs_by_numel_for_decode_sizes(dtype):
    """A rank with a different batch (tokens) than its peers must be caught as a mismatch."""
    for hidden in HIDDEN:
        tags = [P.size_tag(P.OP_ONE_SHOT, t * hidden, dtype) for t in TOKENS]
        assert len(set(tags)) == len(tags), hidden


@pytest.mark.parametrize("dtype", DTYPES)
def test_size_tag_differs_by_numel_for_small_and_power_of_two_sizes(dtype):
    small = [P.size_tag(P.OP_ALL_GATHER, n, dtype) for n in range(1, 60)]
    assert len(set(small)) == len(small)
    powers = [P.size_tag(P.OP_ALL_GATHER, 1 << k, dtype) for k in range(32)]
    assert len(set(powers)) == len(powers)


def test_size_tag_spreads_like_a_hash():
    """16 bits cannot tell every pair of sizes apart, but they must not degenerate: 65,536
    consecutive element counts should fill about 1 - 1/e of the 65,536 values, as a random
    function would (a tag that ignored the low or the high bits of numel would not)."""
    tags = {P.size_tag(P.OP_ONE_SHOT, n, "bfloat16") for n in range(1, 1 << 16)}
    assert len(tags) > 0.6 * (1 << 16)


def test_size_tag_is_deterministic():
    assert P.size_tag(P.OP_TWO_SHOT, 4097, "float16") == P.size_tag(P.OP_TWO_SHOT, 4097, "float16")


# -- lamport_tag --------------------------------------------------------------------------------
@pytest.mark.parametrize("numel", [0, 1, 4096, (1 << 20) + 3, 1 << 40])
@pytest.mark.parametrize("dtype", DTYPES)
def test_lamport_tag_is_never_idle_and_fits_int32(numel, dtype):
    """A tag word idles at 0 and the kernels store it as int32: a written tag is never 0 and
    stays positive; below the marker bit it is exactly the flag words' tag."""
    for op in (P.OP_LAMPORT, P.OP_FUSED_LAMPORT):
        tag = P.lamport_tag(op, numel, dtype)
        assert 0 < tag < 2**31, (op, numel, dtype, tag)
        assert tag & P.LAMPORT_TAG_BIT
        assert tag & P.TAG_MASK == P.size_tag(op, numel, dtype)


def test_lamport_tag_tells_plain_from_fused():
    for numel in (1, 4096, 8192 * 16):
        for dtype in DTYPES:
            assert P.lamport_tag(P.OP_LAMPORT, numel, dtype) != \
                P.lamport_tag(P.OP_FUSED_LAMPORT, numel, dtype)


def test_lamport_tag_tells_the_gpu_tests_mismatches_apart():
    """The calls tests/test_faults_gpu.py and tests/test_lamport_cpu.py mismatch: other size,
    other dtype of the same or another width, the same bytes in another dtype."""
    calls = [(4096, "bfloat16"), (8192, "bfloat16"), (300, "bfloat16"), (4104, "bfloat16"),
             (4096, "float16"), (4096, "float32"), (2048, "float32")]
    tags = {P.lamport_tag(P.OP_LAMPORT, n, d) for n, d in calls}
    assert len(tags) == len(calls)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lamport_tag_differs_by_numel_for_decode_sizes(dtype):
    """Lamport carries decode-step joins: every token count at each hidden size differs."""
    for hidden in HIDDEN:
        tags = [P.lamport_tag(P.OP_LAMPORT, t * hidden, dtype) for t in TOKENS]
        assert len(set(tags)) == len(tags), hidden


# -- decode_error ------------------------------------------------------------------------------
def test_clear_word_is_no_error():
    assert P.decode_error(0, rank=0) is None


@pytest.mark.parametrize("op", sorted(P.OPS))
@pytest.mark.parametrize("phase", sorted(P.PHASES))
def test_timeout_word_round_trips(op, phase):
    err = P.decode_error(word(P.STATUS_TIMEOUT, op, phase, ranks=[1, 3]), rank=2)
    assert type(err) is CommTimeoutError
    assert (err.op, err.phase, err.ranks) == (P.OPS[op], P.PHASES[phase], (1, 3))
    msg = str(err)
    assert "rank 2" in msg and P.OPS[op] in msg and P.PHASES[phase] in msg and "[1, 3]" in msg


@pytest.mark.parametrize("op", sorted(P.OPS))
@pytest.mark.parametrize("phase", sorted(P.PHASES))
def test_mismatch_word_round_trips(op, phase):
    err = P.decode_error(word(P.STATUS_MISMATCH, op, phase, ranks=[0]), rank=1)
    assert type(err) is CommMismatchError
    assert (err.op, err.phase, err.ranks) == (P.OPS[op], P.PHASES[phase], (0,))
    assert "rank 1" in str(err) and "different op, size or dtype" in str(err)


def test_entry_and_exit_barriers_are_told_apart():
    entry = P.decode_error(word(P.STATUS_TIMEOUT, P.OP_ONE_SHOT, P.PHASE_ENTRY, [1]), rank=0)
    exit_ = P.decode_error(word(P.STATUS_TIMEOUT, P.OP_ONE_SHOT, P.PHASE_EXIT, [1]), rank=0)
    assert entry.phase != exit_.phase
    assert "entry" in entry.phase and "exit" in exit_.phase


def test_rank_mask_uses_all_32_bits():
    ranks = (0, 5, 17, 31)
    err = P.decode_error(word(P.STATUS_TIMEOUT, P.OP_BROADCAST, P.PHASE_DATA, ranks), rank=4)
    assert err.ranks == ranks
    every = P.decode_error(word(P.STATUS_MISMATCH, P.OP_COMBINE, P.PHASE_EXIT, range(32)), rank=0)
    assert every.ranks == tuple(range(32))


def test_unknown_codes_are_named_by_number():
    err = P.decode_error(word(P.STATUS_TIMEOUT, 99, 77, [2]), rank=0)
    assert type(err) is CommTimeoutError
    assert (err.op, err.phase) == ("op#99", "phase#77")


@pytest.mark.parametrize("status", [0, 3, 0xFF])
def test_unknown_status_is_not_called_a_timeout(status):
    err = P.decode_error(word(status, P.OP_ONE_SHOT, P.PHASE_ENTRY, [1]), rank=0)
    assert isinstance(err, LLCommError)
    assert not isinstance(err, (CommTimeoutError, CommMismatchError))
    assert "unrecognised error word" in str(err)


# -- resolve_timeout_ms ------------------------------------------------------------------------
def _timeout_setting():
    """LLCOMM_TIMEOUT_MS as Communicator and EPBuffer read it."""
    from llcomm.runtime.settings import EPSettings, TPSettings
    tp, ep = TPSettings.read(2).timeout_ms, EPSettings.read().timeout_ms
    assert tp == ep
    return tp


def test_timeout_default(monkeypatch):
    monkeypatch.delenv("LLCOMM_TIMEOUT_MS", raising=False)
    assert P.resolve_timeout_ms(None, _timeout_setting()) == P.DEFAULT_TIMEOUT_MS == 10_000
    assert P.resolve_timeout_ms(None, _timeout_setting(), P.REFERENCE_DEFAULT_TIMEOUT_MS) == \
        P.REFERENCE_DEFAULT_TIMEOUT_MS


def test_timeout_env_beats_default(monkeypatch):
    monkeypatch.setenv("LLCOMM_TIMEOUT_MS", "250")
    assert P.resolve_timeout_ms(None, _timeout_setting()) == 250
    assert P.resolve_timeout_ms(None, _timeout_setting(), P.REFERENCE_DEFAULT_TIMEOUT_MS) == 250


def test_timeout_argument_beats_env(monkeypatch):
    monkeypatch.setenv("LLCOMM_TIMEOUT_MS", "250")
    assert P.resolve_timeout_ms(40, _timeout_setting()) == 40


@pytest.mark.parametrize("raw", ["abc", "", "1.5", "0", "-5", "1e3", str(P.MAX_TIMEOUT_MS + 1)])
def test_timeout_bad_env_names_the_variable(monkeypatch, raw):
    """A bad value is refused when the settings are read, whether or not an argument is given."""
    monkeypatch.setenv("LLCOMM_TIMEOUT_MS", raw)
    with pytest.raises(ValueError, match="LLCOMM_TIMEOUT_MS"):
        _timeout_setting()


@pytest.mark.parametrize("bad", [0, -1, 1.5, "100", True, False, P.MAX_TIMEOUT_MS + 1])
def test_timeout_bad_argument_names_it(bad):
    with pytest.raises(ValueError, match="timeout_ms="):
        P.resolve_timeout_ms(bad, None)


def test_failure_latch_raises_first_error_then_broken():
    from llcomm.errors import CommBrokenError, CommTimeoutError
    latch = P.FailureLatch(0, "communicator")
    latch.check(0)  # clear word: nothing to raise
    word = (P.STATUS_TIMEOUT << 48) | (P.OP_BROADCAST << 40) | (P.PHASE_ENTRY << 32) | 0b10
    with pytest.raises(CommTimeoutError):
        latch.check(word)
    with pytest.raises(CommBrokenError, match="communicator failed earlier"):
        latch.check(0)  # broken for good, even if the word were cleared
