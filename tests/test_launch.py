"""launch/one_node.sh on CPU: data, capture by two torchrun processes, training, eval, in one run folder."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def one_node(*overrides: str, dry_run: bool = False) -> subprocess.CompletedProcess:
    env = {**ENV, "DRY_RUN": "1"} if dry_run else ENV
    return subprocess.run(["bash", str(REPO / "launch" / "one_node.sh"), "+experiment=tiny", *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.multiproc
@pytest.mark.slow
def test_one_node_script_captures_with_one_process_per_capture_worker(tmp_path):
    run_dir = tmp_path / "run"
    # Four (fake) capture GPUs, two per worker: two capture processes.
    done = one_node(f"run_dir={run_dir}", "show_progress=false", "capture.devices=[0,1,2,3]",
                    "capture.gpus_per_worker=2", "capture.shard_tokens=400", "logging.tensorboard=false")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0 of 2" in done.stdout and "rank 1 of 2" in done.stdout  # both capture processes took shards
    manifest = json.loads((run_dir / "features" / "manifest.json").read_text())
    assert manifest["complete"] and len(manifest["shards"]) > 2
    assert json.loads((run_dir / "eval" / "summary.json").read_text())["overall"]["tau"] >= 1.0


@pytest.mark.multiproc
@pytest.mark.slow
def test_one_node_script_trains_with_online_capture(tmp_path):
    # Its data, capture and eval steps are one process each; only the train step is a job of trainer and capture
    # ranks.
    run_dir = tmp_path / "run"
    done = one_node("capture=online", f"run_dir={run_dir}", "show_progress=false", "capture.devices=[1]",
                    "train.devices=[0]", "logging.tensorboard=false")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (run_dir / "checkpoints" / "final").is_dir()
    assert json.loads((run_dir / "eval" / "summary.json").read_text())["overall"]["tau"] >= 1.0


def commands(done: subprocess.CompletedProcess) -> list[str]:
    assert done.returncode == 0, done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if line.startswith("+ env ")]


@pytest.mark.slow
def test_dry_run_gives_each_capture_worker_its_gpus():
    data, capture, train, evaluate = commands(one_node("capture.devices=[0,1,2,3]", "capture.gpus_per_worker=2",
                                                       "train.devices=[4,5,6,7]", dry_run=True))
    # data and eval load the target like capture worker 0 (layer-wise over its two GPUs).
    assert data.startswith("+ env CUDA_VISIBLE_DEVICES=0,1 python -m dflash.train") and "stages=[data]" in data
    assert capture.startswith("+ env CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun --standalone --nproc_per_node 2 ")
    assert train.startswith("+ env CUDA_VISIBLE_DEVICES=4,5,6,7 torchrun --standalone --nproc_per_node 4 ")
    assert evaluate.startswith("+ env CUDA_VISIBLE_DEVICES=0,1 python") and "stages=[eval]" in evaluate
    # One GPU per worker (the default): one capture process per GPU, as before.
    _, capture, _, evaluate = commands(one_node("capture.devices=[2,3]", dry_run=True))
    assert capture.startswith("+ env CUDA_VISIBLE_DEVICES=2,3 torchrun --standalone --nproc_per_node 2 ")
    assert evaluate.startswith("+ env CUDA_VISIBLE_DEVICES=2 python")


@pytest.mark.slow
def test_dry_run_of_online_capture_is_one_job_of_trainer_then_capture_gpus():
    _, _, train, _ = commands(one_node("capture=online", "capture.devices=[0,1]", "train.devices=[2,3,4]",
                                       dry_run=True))
    assert train.startswith("+ env CUDA_VISIBLE_DEVICES=2,3,4,0,1 torchrun --standalone --nproc_per_node 5 "
                            "--max-restarts 3 ")
    assert "capture.ranks=2" in train and "stages=[train]" in train
    # A target over two GPUs per capture worker: one capture rank per worker, after the three trainer ranks.
    _, _, train, _ = commands(one_node("capture=online", "capture.devices=[0,1,2,3]", "capture.gpus_per_worker=2",
                                       "train.devices=[4,5,6]", dry_run=True))
    assert train.startswith("+ env CUDA_VISIBLE_DEVICES=4,5,6,0,1,2,3 torchrun --standalone --nproc_per_node 5 ")
    assert "capture.ranks=2" in train and "capture.gpus_per_worker=2" in train


def test_a_removed_setting_stops_the_launcher_in_one_line():
    done = one_node("capture=online", "capture.spool_dir=/scratch/spool", dry_run=True)
    assert done.returncode == 2 and "+ env" not in done.stdout
    assert done.stderr.startswith("dflash: error: capture.spool_dir: online capture's file spool was removed")
    assert "Traceback" not in done.stderr


def test_gpus_per_worker_must_divide_the_capture_gpus():
    done = one_node("capture.devices=[0,1,2]", "capture.gpus_per_worker=2", dry_run=True)
    assert done.returncode == 2 and done.stderr == (
        "dflash: error: capture.gpus_per_worker=2 does not divide the 3 capture GPU(s): list a multiple of 2 GPUs in "
        "capture.devices\n")
    assert "+ env" not in done.stdout


def test_unlisted_capture_gpus_are_one_worker_s_from_gpu_0():
    """capture.devices unset with capture.gpus_per_worker=2: GPUs 0,1 for the one capture worker, and for the data
    and eval steps that load the target like it (it was GPU 0 alone, and 1 // 2 = 0 capture processes)."""
    data, capture, _, evaluate = commands(one_node("capture.gpus_per_worker=2", dry_run=True))
    assert data.startswith("+ env CUDA_VISIBLE_DEVICES=0,1 python -m dflash.train ")
    assert capture.startswith("+ env CUDA_VISIBLE_DEVICES=0,1 torchrun --standalone --nproc_per_node 1 ")
    assert evaluate.startswith("+ env CUDA_VISIBLE_DEVICES=0,1 python -m dflash.train ")
    _, _, train, _ = commands(one_node("capture=online", "capture.gpus_per_worker=2", "train.devices=[2]",
                                       dry_run=True))
    assert train.startswith("+ env CUDA_VISIBLE_DEVICES=2,0,1 torchrun --standalone --nproc_per_node 2 ")
    assert "capture.ranks=1" in train
    # capture.ranks_per_node=2 of 2 GPUs each: GPUs 0-3, the two capture ranks this node runs.
    _, _, train, _ = commands(one_node("capture=online", "capture.gpus_per_worker=2", "capture.ranks_per_node=2",
                                       "train.devices=[4]", dry_run=True))
    assert train.startswith("+ env CUDA_VISIBLE_DEVICES=4,0,1,2,3 torchrun --standalone --nproc_per_node 3 ")
    # Unlisted capture GPUs sharing the trainers' default GPU 0: the suggestion lists a worker's worth.
    shared = one_node("capture=online", "capture.gpus_per_worker=2", "device=cuda", dry_run=True)
    assert shared.returncode == 2 and "capture.devices=[0,1] share GPU 0" in shared.stderr
    assert shared.stderr.endswith("e.g. train.devices=[0] capture.devices=[1,2]\n")


@pytest.mark.parametrize("overrides, line", [
    (("capture.devices=[0,0]", "train.devices=[2,3]"),
     "capture.devices=[0,0] lists GPU 0 more than once; list each GPU once"),
    (("train.devices=[2,2]",), "train.devices=[2,2] lists GPU 2 more than once; list each GPU once"),
    (("capture.devices=[-1]",), "capture.devices=[-1]: GPU ids count from 0; list GPUs 0 and up, each once"),
    (("train.devices=[0,-2]",), "train.devices=[0,-2]: GPU ids count from 0; list GPUs 0 and up, each once"),
], ids=["capture-twice", "train-twice", "capture-negative", "train-negative"])
def test_a_device_list_with_a_gpu_twice_or_a_negative_id_is_refused_in_one_line(overrides, line):
    """Each was run: a GPU twice in CUDA_VISIBLE_DEVICES and a rank more; a negative id hides the GPUs."""
    done = one_node(*overrides, dry_run=True)
    assert done.returncode == 2 and done.stdout == "" and done.stderr == f"dflash: error: {line}\n"


@pytest.mark.parametrize("script", ["one_node.sh", "multi_node.sh"])
@pytest.mark.parametrize("override, line", [
    ("train.lr=(", "train.lr=(: Hydra reads a value holding the characters ( only when quoted: train.lr='\"(\"'"),
    ("capture.devices=0", "capture.devices=0: expected a list of ints, e.g. capture.devices=[0]"),
], ids=["unparsed", "unmerged"])
def test_an_override_hydra_cannot_compose_stops_the_launcher_in_the_commands_line(script, override, line):
    """The line python -m dflash.train ends with (exit status 2), not Hydra's traceback."""
    done = one_node(override, dry_run=True) if script == "one_node.sh" else multi_node(0, override)
    assert done.returncode == 2 and done.stdout == "" and done.stderr == f"dflash: error: {line}\n"


def test_every_node_s_capture_ranks_must_leave_a_trainer_rank():
    """4 capture ranks of 2 GPUs on an 8-GPU node: no trainer, and a job torchrun would restart MAX_RESTARTS times."""
    done = multi_node(0, "capture=online", "capture.ranks_per_node=4", "capture.gpus_per_worker=2")
    assert done.returncode == 2 and done.stdout == "" and done.stderr == (
        "multi_node.sh: capture.ranks_per_node=4 capture ranks of 2 GPU(s) take 8 of a node's GPUS_PER_NODE=8 GPUs, "
        "leaving no trainer rank: capture on fewer GPUs a node, or set GPUS_PER_NODE to the node's GPUs\n")
    [kept] = torchrun_lines(multi_node(0, "capture=online", "capture.ranks_per_node=3", "capture.gpus_per_worker=2"))
    assert "--nproc_per_node 5 " in kept  # 2 trainer GPUs + 3 capture ranks


def test_the_printed_commands_read_back_as_the_commands_run(tmp_path):
    """Each launcher prints its commands quoted, so a line copied into a shell runs what the launcher ran."""
    spaced = f"run_dir={tmp_path / 'with space'}"
    data, *_ = commands(one_node(spaced, "capture.devices=[0,1]", dry_run=True))
    assert shlex.split(data)[1:] == ["env", "CUDA_VISIBLE_DEVICES=0", "python", "-m", "dflash.train",
                                     "+experiment=tiny", spaced, "capture.devices=[0,1]", "stages=[data]"]
    assert f"'{spaced}' 'capture.devices=[0,1]' 'stages=[data]'" in data  # a [list] is no shell pattern either
    [train] = torchrun_lines(multi_node(1, spaced))
    assert shlex.split(train)[-3:] == ["+experiment=tiny", spaced, "stages=[train]"]
    (tmp_path / "hosts").write_text("node-a slots=8\n")
    shown = deepspeed_hostfile("hosts", spaced, cwd=tmp_path)
    assert shlex.split(shown.stdout)[-2:] == [spaced, "stages=[train]"]


def multi_node(node_rank: int, *overrides: str, script: str = "multi_node.sh",
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "launch" / script), "2", str(node_rank), "nodeA", "+experiment=tiny",
                           *overrides], cwd=REPO, env={**ENV, "DRY_RUN": "1", "GPUS_PER_NODE": "8", **(env or {})},
                          capture_output=True, text=True, timeout=600)


def torchrun_lines(done: subprocess.CompletedProcess) -> list[str]:
    assert done.returncode == 0, done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if line.startswith("+ torchrun ")]


@pytest.mark.slow
def test_dry_run_of_several_nodes_runs_trainer_gpus_plus_capture_ranks_on_each():
    online = ("capture=online",)
    [plain] = torchrun_lines(multi_node(1))
    assert plain.startswith("+ torchrun --nnodes 2 --node_rank 1 --nproc_per_node 8 --master_addr nodeA ")
    assert "--max-restarts" not in plain and plain.endswith("'stages=[train]'")
    # The job's last 8 ranks capture (node 1's GPUs): every node runs 8 ranks, restarted after a rank dies, all nodes
    # together (the c10d rendezvous); a static one only when asked for.
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in multi_node(1).stdout
    launched = multi_node(0, *online, "capture.ranks=8")
    assert "+ export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1\n" in launched.stdout  # a store per start (rank_link.py)
    [last] = torchrun_lines(launched)
    assert last.startswith("+ torchrun --nnodes 2 --node_rank 0 --nproc_per_node 8 --max-restarts 3 --rdzv_backend "
                           "c10d --rdzv_endpoint nodeA:29500 ")
    [static] = torchrun_lines(multi_node(0, *online, "capture.ranks=8", env={"RDZV_BACKEND": "static"}))
    assert "--master_addr nodeA --master_port 29500 " in static and "--rdzv_backend" not in static
    assert "--max-restarts" not in static  # its healthy nodes would never restart: no restart at all
    # Every node's last 2 ranks capture on 2 GPUs each: 4 trainer GPUs + 2 capture ranks a node.
    [every] = torchrun_lines(multi_node(1, *online, "capture.ranks_per_node=2", "capture.gpus_per_worker=2"))
    assert every.startswith("+ torchrun --nnodes 2 --node_rank 1 --nproc_per_node 6 --max-restarts 3 ")
    # A capture rank of several GPUs with the job's last ranks capturing: one node only, refused before any work.
    refused = multi_node(0, *online, "capture.gpus_per_worker=2")
    assert refused.returncode == 2 and "set capture.ranks_per_node" in refused.stderr and "+ " not in refused.stdout


@pytest.mark.slow
def test_dry_run_of_the_slurm_job_runs_multi_node_on_every_node(tmp_path):
    """srun and scontrol stand-ins: srun runs its command once per node with that node's SLURM_NODEID."""
    (tmp_path / "srun").write_text('#!/usr/bin/env bash\nfor id in 0 1; do SLURM_NODEID=$id "$@"; done\n')
    (tmp_path / "scontrol").write_text("#!/usr/bin/env bash\nprintf 'nodeA\\nnodeB\\n'\n")
    for stand_in in ("srun", "scontrol"):
        (tmp_path / stand_in).chmod(0o755)
    env = {**ENV, "DRY_RUN": "1", "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "node[A-B]", "SLURM_SUBMIT_DIR": str(REPO)}
    done = subprocess.run(["bash", str(REPO / "launch" / "slurm.sbatch"), "+experiment=tiny", "capture=online",
                           "capture.ranks_per_node=1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    nodes = torchrun_lines(done)
    assert [line.split("--node_rank ")[1].split()[0] for line in nodes] == ["0", "1"]
    assert all("--nproc_per_node 8 --max-restarts 3 --rdzv_backend c10d --rdzv_endpoint nodeA:29500 " in line
               for line in nodes)


@pytest.mark.slow
def test_dry_run_of_the_slurm_capture_job_captures_with_one_process_per_capture_gpu(tmp_path):
    """An srun stand-in that runs its command once, as one task on one node does."""
    (tmp_path / "srun").write_text('#!/usr/bin/env bash\nexec "$@"\n')
    (tmp_path / "srun").chmod(0o755)
    env = {**ENV, "DRY_RUN": "1", "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(REPO)}
    run_dir = tmp_path / "with space" / "run"  # an override with a space reaches every command whole
    done = subprocess.run(["bash", str(REPO / "launch" / "slurm_capture.sbatch"), "+experiment=tiny",
                           f"run_dir={run_dir}", "capture.devices=[0,1,2,3,4,5,6,7]"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    data, capture = commands(done)  # data and capture only: the trainer job trains
    assert data.startswith("+ env CUDA_VISIBLE_DEVICES=0 python -m dflash.train") and "stages=[data]" in data
    assert capture.startswith("+ env CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 torchrun --standalone --nproc_per_node 8 ")
    assert f"run_dir={run_dir}" in shlex.split(capture) and "stages=[capture]" in capture


def test_online_capture_on_gpus_shared_by_trainer_and_capture_ranks_is_refused_in_one_line():
    """Both device lists default to [0]: the online job's CUDA_VISIBLE_DEVICES listed GPU 0 twice."""
    done = one_node("capture=online", "device=cuda", dry_run=True)
    assert done.returncode == 2 and "+ env" not in done.stdout
    assert done.stderr.startswith("dflash: error: capture=online runs its trainer and capture ranks at once, one GPU "
                                  "each, but train.devices=[0] and capture.devices=[0] share GPU 0")
    assert "capture.devices=[1]" in done.stderr
    # On the CPU there are no GPUs to share.
    assert one_node("capture=online", "device=cpu", dry_run=True).returncode == 0


def test_the_shared_gpu_check_is_one_node_s_online_job_s_only(tmp_path):
    """multi_node.sh gives every node all its GPUs and never reads the two lists; CAPTURE_ONLY runs no job."""
    done = subprocess.run(["bash", str(REPO / "launch" / "multi_node.sh"), "2", "0", "nodeA", "+experiment=tiny",
                           "capture=online", "capture.ranks_per_node=1", "device=cuda"],
                          capture_output=True, text=True, env={**os.environ, "DRY_RUN": "1"}, timeout=120)
    assert done.returncode == 0, done.stderr
    done = subprocess.run(["bash", str(REPO / "launch" / "one_node.sh"), "+experiment=tiny", "capture=online",
                           "device=cuda"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DRY_RUN": "1", "CAPTURE_ONLY": "1"})
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("script", ["one_node.sh", "multi_node.sh", "deepspeed_hostfile.sh"])
def test_each_launcher_has_help_and_a_usage_line(script):
    shown = subprocess.run(["bash", str(REPO / "launch" / script), "--help"], capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 0 and "Usage: launch/" + script in shown.stdout and "#" not in shown.stdout[:2]
    if script != "one_node.sh":  # it takes overrides alone; the others need their node arguments first
        bare = subprocess.run(["bash", str(REPO / "launch" / script)], capture_output=True, text=True, timeout=60)
        assert bare.returncode == 2 and bare.stderr.startswith(f"usage: launch/{script} ")


def deepspeed_hostfile(hostfile: str, *overrides: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "launch" / "deepspeed_hostfile.sh"), hostfile, "10.0.0.1",
                           "+experiment=tiny", *overrides], cwd=cwd, env={**ENV, "DRY_RUN": "1"},
                          capture_output=True, text=True, timeout=60)


def test_the_deepspeed_launcher_prints_its_command_in_a_dry_run(tmp_path):
    (tmp_path / "hosts").write_text("node-a slots=8\n")
    shown = deepspeed_hostfile("hosts", cwd=tmp_path)
    assert shown.returncode == 0 and shown.stdout == (
        "+ deepspeed --hostfile hosts --master_addr 10.0.0.1 --master_port 29500 --module dflash.train "
        "+experiment=tiny 'stages=[train]'\n")


def test_the_deepspeed_launcher_refuses_a_hostfile_that_is_not_there(tmp_path):
    """deepspeed itself goes on without one, training on the local node alone."""
    done = deepspeed_hostfile("no-such-hosts", cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("deepspeed_hostfile.sh: HOSTFILE no-such-hosts is not a file (deepspeed would train on this "
                           "node alone): give one of lines like \"node-a slots=8\" (launch/hostfile.example)\n")


def test_trainer_gpus_without_a_launcher_are_warned_about(tmp_path, monkeypatch, capsys):
    """train.devices is read by the launch scripts alone: a plain command that names several and trains, trains as
    one rank; one that does not train (data, capture, an evaluation) is not warned."""
    from dflash.config import compose
    from dflash.pipeline import Pipeline

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    overrides = ["+experiment=tiny", "show_progress=false", "data.limit=4", "train.devices=[2,3,4]",
                 "train.max_steps=1"]
    Pipeline(compose([*overrides, "stages=[data,capture]", f"run_dir={tmp_path / 'plain'}"])).run()
    assert "train.devices" not in capsys.readouterr().err
    Pipeline(compose([*overrides, "stages=[train]", f"run_dir={tmp_path / 'plain'}"])).run()
    assert ("dflash: warning: train.devices=[2, 3, 4] places one trainer rank per GPU only under launch/one_node.sh "
            "or launch/multi_node.sh (docs/distributed.md): this command runs as one process on one device, with a "
            "global batch of 4 sequences, not 12") in capsys.readouterr().err
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")  # what the scripts set for each process they start
    Pipeline(compose([*overrides, "stages=[train]", f"run_dir={tmp_path / 'plain'}"])).run()
    assert "train.devices" not in capsys.readouterr().err
