"""Multi-process chat: 2 CPU processes x 2 host devices under jax.distributed (gloo) form one 4-device
mesh; only process 0 reads stdin and prints, and its greedy answers equal those of one process
with 4 devices."""
import subprocess
import sys

import dsv3_jax
from dsv3_jax.tokenizer import Tokenizer
from processes import free_port, killed_on_exit, two_device_env
from test_chat import ANSWER, ROOT, TINY, expected_turns


def test_two_processes_chat_like_one(tmp_path):
    turns = ["Hello! Tell me about the weather.", "What is 3 plus 4?", "/clear", "Tell me about music."]
    address, env = f"127.0.0.1:{free_port()}", two_device_env()
    command = [sys.executable, "-m", "dsv3_jax.chat", "--tiny", "--interactive", "--temperature", "0",
               "--max-new-tokens", "64"]
    # process 0 gets its settings as flags, process 1 through the environment
    leader = subprocess.Popen(command + ["--coordinator-address", address, "--num-processes", "2", "--process-id", "0"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=ROOT, env=env)
    follower_env = dict(env, JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="1")
    follower = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=ROOT, env=follower_env)
    with killed_on_exit(leader, follower):
        out0, err0 = leader.communicate("\n".join(turns) + "\n", timeout=150)
        out1, err1 = follower.communicate(timeout=30)
    assert leader.returncode == 0, err0[-2000:]
    assert follower.returncode == 0, err1[-2000:]
    # only process 0 prints, and only the conversation: gloo's C++ connection reports ("[Gloo] Rank 0 is
    # connected to 1 peer ranks...") go to stderr
    assert out1 == ""
    assert "Gloo" not in out0 and out0.startswith(">>> ") and out0.endswith(">>> \n"), out0
    answers = [a for a, _ in ANSWER.findall(out0)]

    model = dsv3_jax.load(TINY, num_devices=4, max_batch_size=1, max_seq_len=4096)
    assert model.mesh.devices.size == 4
    expected = expected_turns(model, Tokenizer.from_dir(TINY), turns, temperature=0.0, max_new_tokens=64)
    assert answers == expected and len(expected) == 3


def test_processes_with_different_flags_fail_clearly():
    """A follower started with other generation flags is one clear error on every process, not a hang."""
    address, env = f"127.0.0.1:{free_port()}", two_device_env()
    base = [sys.executable, "-m", "dsv3_jax.chat", "--tiny", "--interactive", "--temperature", "0",
            "--coordinator-address", address, "--num-processes", "2"]
    processes = [subprocess.Popen(base + ["--max-new-tokens", tokens, "--process-id", str(rank)],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  cwd=ROOT, env=env)
                 for rank, tokens in ((0, "64"), (1, "32"))]
    with killed_on_exit(*processes):
        results = [p.communicate(timeout=120) for p in processes]
    for process, (_, err) in zip(processes, results):
        assert process.returncode == 1
        assert "processes [1] were started with other flags than process 0" in err
