"""The token hop under torchrun (on by default there, tp = 1): PP = 3 gives the tokens of one
process without it (PP = 2: tests/launch/test_torchrun.py, whose tp = 1 job is compared with
one process too; `token_hop_on` resolves auto on alike on every rank:
tests/executors/test_token_hop_switch.py)."""
import pytest

from test_torchrun import WORKLOAD, _unshare_ok, outputs, ray_run, torchrun

pytestmark = pytest.mark.slow  # torchrun processes (pytest.ini)


@pytest.mark.skipif(not _unshare_ok(), reason="needs unshare -n (a private network namespace)")
@pytest.mark.parametrize("pp", [3])
def test_torchrun_token_hop_gives_the_tokens_of_one_process(tmp_path, pp):
    load = [*WORKLOAD, "--set", "output_len=10", "--set", "chunk_size=16"]
    r = ray_run(tmp_path / "one", *load, "--set", "executor=local", "--set", "pp=1")
    assert r.returncode == 0, r.stderr[-3000:]
    job = torchrun(tmp_path / "hop", pp, *load, "--set", f"pp={pp}")
    assert job.returncode == 0, job.stderr[-3000:]
    a, b = outputs(tmp_path / "hop"), outputs(tmp_path / "one")
    assert len(a) == 5 and all(len(o["token_ids"]) == 10 for o in a)
    assert a == b  # token for token
