"""The run journal (`core/journal.py`, torch-free): what rank 0 writes, what a restarted
rank 0 reads back, and what it refuses."""
import json
import subprocess
import sys
from types import SimpleNamespace as NS

import pytest

from pp_runtime.core import journal
from pp_runtime.core.journal import Journal, JournalMismatch, read, resume_tokens, run_id

RUN = run_id({"model": {"name": "tiny-gpt"}, "workload": {"seed": 0}}, None)


def _mb(mb_id, *seqs):
    """A micro-batch of (request id, samples?) sequences and the tokens it sampled."""
    mb = NS(mb_id=mb_id, seqs=[NS(request_id=r, sampling=object() if s else None)
                               for r, s, _ in seqs])
    return mb, NS(tokens={r: t for r, s, t in seqs if s})


def test_the_journal_imports_no_torch():
    code = ("import sys; import pp_runtime.core.journal; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_what_is_written_is_read_back_in_order(tmp_path):
    j = Journal(tmp_path / journal.NAME, RUN, {}, what="tiny")
    j.on_microbatch(*_mb(0, (0, False, None), (1, True, 11)))  # 0 mid-prefill: no token
    j.on_microbatch(*_mb(1, (0, True, 5), (1, True, 12)))
    j.on_microbatch(*_mb(2, (1, True, 13)))
    got = read(tmp_path / journal.NAME, RUN)
    assert got.tokens == {0: [5], 1: [11, 12, 13]} and not got.done
    assert (got.lines, got.dropped, got.num_tokens) == (3, 0, 4)
    j.done()
    assert read(tmp_path / journal.NAME, RUN).done


def test_no_journal_is_none(tmp_path):
    assert read(tmp_path / journal.NAME, RUN) is None


def test_a_line_cut_short_and_what_follows_are_dropped(tmp_path):
    path = tmp_path / journal.NAME
    j = Journal(path, RUN, {})
    j.record(0, {0: 1})
    j.record(1, {0: 2})
    j.close()
    path.write_bytes(path.read_bytes() + b'{"mb":2,"t":{"0":3' + b"\0" * 7)  # a crash
    got = read(path, RUN)
    assert got.tokens == {0: [1, 2]} and got.dropped == 1


def test_another_runs_journal_is_refused_in_one_line(tmp_path):
    path = tmp_path / journal.NAME
    other = run_id({"model": {"name": "tiny-gpt"}, "workload": {"seed": 1}}, None)
    Journal(path, other, {0: [4]}, what="tiny-gpt, workload seed 1").close()
    with pytest.raises(JournalMismatch, match="journal of another run") as exc:
        read(path, RUN)
    assert "\n" not in str(exc.value) and "workload seed 1" in str(exc.value)
    path.write_text("not a journal\n")
    with pytest.raises(JournalMismatch, match="is not a pp_runtime journal"):
        read(path, RUN)


def test_the_run_id_is_the_config_and_the_checkpoint(tmp_path):
    cfg = {"model": {"name": "m"}, "workload": {"seed": 0}}
    assert run_id(cfg, None) == run_id(json.loads(json.dumps(cfg)), None)
    assert run_id(cfg, tmp_path) != run_id(cfg, None) != run_id({**cfg, "seed": 1}, None)


def test_a_complete_request_resumes_without_its_last_token():
    tokens = {0: [1, 2, 3], 1: [4], 2: [7, 8, 9, 9]}
    assert resume_tokens(tokens, [3, 2, 9]) == {0: [1, 2], 1: [4], 2: [7, 8, 9, 9]}
    assert resume_tokens({0: [5]}, [1]) == {}  # one token to make: nothing to pass
    with pytest.raises(JournalMismatch, match="names request 3; the workload has 2"):
        resume_tokens({3: [1]}, [4, 4])


def test_a_new_attempt_starts_from_its_base_and_never_repeats_a_token(tmp_path):
    """Attempt 1 resumes request 0 without its last token and samples it again: the
    rewritten header holds the base, so the journal's tokens are the request's, once."""
    path = tmp_path / journal.NAME
    j = Journal(path, RUN, {})
    for mb, t in enumerate((10, 11, 12)):
        j.record(mb, {0: t, 1: 20 + mb})
    j.close()
    base = resume_tokens(read(path, RUN).tokens, [3, 5])
    assert base == {0: [10, 11], 1: [20, 21, 22]}
    j = Journal(path, RUN, base, resumes=[{"attempt": "1", "tokens": 6}])  # attempt 1
    j.record(0, {0: 12, 1: 23})
    j.record(1, {1: 24})
    j.done()
    got = read(path, RUN)
    assert got.tokens == {0: [10, 11, 12], 1: [20, 21, 22, 23, 24]} and got.done
    assert got.resumes == [{"attempt": "1", "tokens": 6}]
    assert not (tmp_path / (journal.NAME + ".tmp")).exists()
