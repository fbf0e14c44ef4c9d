"""A torchrun deployment heals: a rank that dies or hangs mid-run makes torchrun's agent
restart the whole group (`--max-restarts 1`), rank 0 resumes from its journal, and the
outputs equal a fault-free run's, token for token (greedy).

Real jobs under `pp_runtime.cli.agent` on 127.0.0.1 (gloo, tiny model, PP = 2 or 3); the fault
comes from the launcher's test hook PP_RUNTIME_FAULT (first attempt only)."""
import json
import os
import subprocess
import sys
import time

import pytest

from pp_runtime.core import journal
from pp_runtime.core.net import free_port

pytestmark = pytest.mark.slow  # torchrun processes (pytest.ini)

ARGS = ["--config", "tiny", "--quiet", "--set", "workload.kind=fixed", "--set", "prompt_len=40",
        "--set", "output_len=12", "--requests", "6", "--set", "threads_per_worker=1",
        "--set", "step_timeout_s=10"]


def agent(out, fault=None, restarts=1, pp=2):
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    env.pop("PP_RUNTIME_FAULT", None)
    if fault:
        env["PP_RUNTIME_FAULT"] = fault
    cmd = [sys.executable, "-m", "pp_runtime.cli.agent", "--nnodes", "1", "--nproc-per-node",
           str(pp), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           "--max-restarts", str(restarts), "-m", "pp_runtime.cli.torchrun", "--out", str(out),
           *ARGS, "--set", f"pp={pp}"]
    t0 = time.monotonic()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    r.wall_s = time.monotonic() - t0
    return r


def outputs(d):
    return [json.loads(line) for line in (d / "outputs.jsonl").read_text().splitlines()]


def journal_tokens(d):
    path = d / journal.NAME
    run = json.loads(path.read_text().splitlines()[0])["run"]
    return journal.read(path, run)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The fault-free run's outputs, by pipeline depth (each run once)."""
    runs = {}

    def at(pp=2):
        if pp not in runs:
            out = tmp_path_factory.mktemp(f"fault_free_pp{pp}")
            r = agent(out, pp=pp)
            assert r.returncode == 0, r.stderr[-3000:]
            assert "resuming" not in r.stderr
            runs[pp] = outputs(out)
        return runs[pp]
    return at


def check_healed(r, out, reference):
    """The run succeeded after one restart that resumed from a non-empty journal, and its
    outputs are the fault-free run's; the journal holds exactly the outputs' tokens."""
    assert r.returncode == 0, r.stderr[-4000:]
    assert "PP_RUNTIME_FAULT: rank 1 faults" in r.stderr
    resumed = [ln for ln in r.stderr.splitlines() if "rank 0: resuming from" in ln]
    assert len(resumed) == 1 and "(attempt 1)" in resumed[0], r.stderr[-4000:]
    assert not resumed[0].split(": ")[2].startswith("0 tokens"), resumed[0]
    got = outputs(out)
    assert len(got) == 6 and all(len(o["token_ids"]) == 12 for o in got)
    assert got == reference
    head = json.loads((out / journal.NAME).read_text().splitlines()[0])
    assert head["base"], "the second attempt started from nothing"
    assert [(h["attempt"], h["tokens"] > 0) for h in head["resumes"]] == [("1", True)]
    replay = journal_tokens(out)
    assert replay.done and replay.tokens == {i: o["token_ids"] for i, o in enumerate(got)}


def test_a_killed_rank_is_restarted_and_the_run_resumes(tmp_path, reference):
    """The middle stage of three (the hang below: the last of two)."""
    r = agent(tmp_path, "rank=1,after_mb=12,mode=kill", pp=3)  # the first token (sampled in
    #   micro-batch 5 of 47) is journaled by then even under load: at 8 it raced the kill
    check_healed(r, tmp_path, reference(3))
    assert "exitcode: -9" in r.stderr or "exitcode  : -9" in r.stderr


def test_a_stopped_rank_is_given_up_after_the_step_timeout_and_the_run_resumes(tmp_path, reference):
    """SIGSTOP (a hang that takes no signal): rank 0's step timeout ends the attempt, and
    the agent's SIGTERM is followed by SIGCONT (cli/agent.patch_stop), so the stopped rank
    exits at once instead of after torch's 30 s wait for SIGKILL."""
    r = agent(tmp_path, "rank=1,after_mb=8,mode=stop")
    check_healed(r, tmp_path, reference())
    assert "rank 0: the pipeline broke (RuntimeError: rank 1 (stage 1), micro-batch " in r.stderr  # its number: where rank 0 waits when the stop lands
    assert "Timed out waiting 10000ms" in r.stderr
    assert r.wall_s < 40, r.wall_s  # 10 s step timeout + restart (~25 s); not + 30 s to SIGKILL


def test_a_journal_of_another_run_is_refused_not_replayed(tmp_path):
    other = journal.run_id({"model": {"name": "something else"}}, None)
    journal.Journal(tmp_path / journal.NAME, other, {0: [1, 2]}, what="another run").close()
    before = (tmp_path / journal.NAME).read_bytes()
    r = agent(tmp_path, None, restarts=0)
    assert r.returncode != 0
    assert f"error (rank 0): {tmp_path / journal.NAME} is the journal of another run " \
           "(another run;" in r.stderr, r.stderr[-3000:]
    assert (tmp_path / journal.NAME).read_bytes() == before
    assert not (tmp_path / "outputs.jsonl").exists()


def test_after_the_agent_gives_up_the_same_command_resumes(tmp_path, reference):
    """No restart left (`--max-restarts 0`): the job fails and leaves its journal; running
    the same command again resumes from it and ends with the fault-free outputs."""
    r = agent(tmp_path, "rank=1,after_mb=8,mode=kill", restarts=0)
    assert r.returncode != 0
    if (tmp_path / "outputs.jsonl").exists():  # rank 0 saw the gloo error before its SIGTERM
        assert "error" in {o["finish_reason"] for o in outputs(tmp_path)}
    assert not journal_tokens(tmp_path).done
    r = agent(tmp_path, None, restarts=0)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rank 0: resuming from" in r.stderr and "(attempt 0)" in r.stderr
    assert outputs(tmp_path) == reference()
    assert journal_tokens(tmp_path).done
