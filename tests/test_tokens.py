"""Token files for `launch --data` (plan3d.run.tokens): formats, checks, a layout-independent batch order."""
import struct

import numpy as np
import pytest

from plan3d.run import tokens
from plan3d.errors import SpecError


def megatron_pair(tmp_path, ids, code=8, dtype="<u2"):
    """A Megatron indexed dataset of one document: PREFIX.bin and a minimal PREFIX.idx header."""
    np.asarray(ids, dtype=dtype).tofile(tmp_path / "corpus.bin")
    header = tokens.MEGATRON_MAGIC + struct.pack("<Q", 1) + struct.pack("<B", code) + struct.pack("<QQ", 1, 2)
    (tmp_path / "corpus.idx").write_bytes(header)
    return tmp_path / "corpus.bin"


def test_nanogpt_bin_round_trips(tmp_path):
    path = tokens.write_tokens(tmp_path / "a.bin", np.arange(100) % 50)
    assert path.stat().st_size == 200  # uint16
    got = tokens.open_tokens(path, vocab=50, window=9)
    assert got.tolist() == (np.arange(100) % 50).tolist()


def test_u32_name_reads_four_byte_ids(tmp_path):
    path = tokens.write_tokens(tmp_path / "a.u32.bin", [70000, 1, 2, 3])
    assert path.stat().st_size == 16
    assert tokens.open_tokens(path, vocab=70001, window=2).tolist() == [70000, 1, 2, 3]


def test_megatron_index_names_the_dtype(tmp_path):
    path = megatron_pair(tmp_path, [5, 6, 7, 8], code=4, dtype="<i4")
    assert tokens.token_dtype(path) == np.dtype(np.int32)
    assert tokens.open_tokens(path, vocab=9, window=2).tolist() == [5, 6, 7, 8]


def test_bad_megatron_index_is_refused(tmp_path):
    path = megatron_pair(tmp_path, [1, 2, 3])
    (tmp_path / "corpus.idx").write_bytes(b"NOTANIDX" * 3)
    with pytest.raises(SpecError, match="MMIDIDX"):
        tokens.open_tokens(path, vocab=9, window=2)


@pytest.mark.parametrize("ids, vocab, window, words", [
    ([1, 2, 300], 256, 2, "outside the model's vocabulary"),
    ([1, 2, 3], 256, 8, "at least 8 tokens"),
])
def test_unusable_files_say_what_to_change(tmp_path, ids, vocab, window, words):
    path = tokens.write_tokens(tmp_path / "a.bin", ids)
    with pytest.raises(SpecError, match=words):
        tokens.open_tokens(path, vocab, window)


def test_missing_file_and_odd_size(tmp_path):
    with pytest.raises(SpecError, match="no such token file"):
        tokens.open_tokens(tmp_path / "nope.bin", 256, 2)
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(SpecError, match="whole number"):
        tokens.open_tokens(tmp_path / "odd.bin", 256, 1)


def test_bundled_sample_is_byte_text_for_tiny_gpt():
    corpus = tokens.open_tokens("python-docs", vocab=256, window=33)
    text = bytes(np.asarray(corpus[:200], dtype=np.uint8)).decode("ascii")
    assert "statement" in text
    assert len(corpus) >= 100_000


def test_windows_depend_on_seed_and_step_only():
    corpus = np.arange(1000)
    a = tokens.global_windows(corpus, seed=3, step=5, batch=8, seq=16)
    b = tokens.global_windows(corpus, seed=3, step=5, batch=8, seq=16)
    c = tokens.global_windows(corpus, seed=3, step=6, batch=8, seq=16)
    assert a.shape == (8, 17) and (a == b).all() and not (a == c).all()
    assert (np.diff(a, axis=1) == 1).all()  # each row is a contiguous window of the corpus
    assert a.max() < 1000
