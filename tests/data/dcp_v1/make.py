"""How the dcp_v1 fixture was made (with cudasnap before dcp_names): python make.py OUT."""
import sys

import torch

import cudasnap
from cudasnap.tools.export import export_dcp

out = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
opt = torch.optim.AdamW([{"params": model[0].parameters(), "lr": 1e-2},
                         {"params": model[2].parameters(), "lr": 3e-3}])
snap = cudasnap.Snapshotter(model, opt, directory=f"{out}/ckpt", backend="cpu")
for step in range(3):
    model(torch.randn(4, 6)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    snap.boundary(step)
snap.close()
export_dcp(f"{out}/ckpt", f"{out}/export")
