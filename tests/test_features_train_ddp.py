"""``train_on_activations`` / ``train_dictionary`` under ``torchrun``: two gloo processes each
take half of every step's rows, average the gradients, and end with the dictionary one process
trains (AuxK off: its loss is normalised per rank's rows)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = '''
import sys

import torch
import torch.distributed as dist

from handformer.features import train_on_activations

torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
dirs = torch.randn(12, 8, generator=g)
dirs = dirs / dirs.norm(dim=-1, keepdim=True)

def data(step):
    gg = torch.Generator().manual_seed(100 + step)
    idx = torch.rand(64, 12, generator=gg).argsort(-1)[:, :2]
    a = torch.zeros(64, 12).scatter(-1, idx, 1 + torch.rand(64, 2, generator=gg))
    return a @ dirs + 0.3

r = train_on_activations(data, d_sae=16, k=2, rows=64, tokens=64 * 30, lr=1e-2,
                         aux_coeff=0.0, progress=False)
rank = int(__import__("os").environ.get("RANK", 0))
torch.save({k: v.detach() for k, v in r.dictionaries["activations"].state_dict().items()},
           f"{sys.argv[1]}.{rank}")
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_ranks_train_the_dictionary_one_process_does(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    one = subprocess.run([sys.executable, str(script), str(tmp_path / "one")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(script),
         str(tmp_path / "two")],
        capture_output=True, text=True, timeout=300, env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    single = torch.load(tmp_path / "one.0")
    for rank in (0, 1):
        ranked = torch.load(tmp_path / f"two.{rank}")
        for name, value in single.items():
            torch.testing.assert_close(ranked[name], value, atol=1e-4, rtol=1e-4)
    moved = torch.load(tmp_path / "two.0")["b_enc"].abs().max()
    assert moved > 1e-3  # it trained
