"""A module whose state_dict is not its parameters, as torchtitan's ``FusedQKVLinear``: q, k
and v in one parameter ``wqkv``, split into ``wq``/``wk``/``wv`` by a state_dict hook and
fused again by a load pre-hook (issue 32). ``copy``: the hook returns new tensors (what
DTensor ops under FSDP2 and format converters make); else views of the parameter. A
subclass may override ``_split`` (the hooks registered are the class's own)."""
from __future__ import annotations

from typing import Any

import torch


class FusedQKV(torch.nn.Module):
    def __init__(self, d: int = 16, h: int = 6, copy: bool = True) -> None:
        super().__init__()
        self.wqkv = torch.nn.Parameter(torch.randn(3 * h, d) / 4)
        self.copy = copy
        self._register_state_dict_hook(type(self)._split)
        self._register_load_state_dict_pre_hook(type(self)._fuse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (x @ self.wqkv.t()).chunk(3, dim=-1)
        return torch.tanh(q * k + v)

    @staticmethod
    def _split(mod: Any, sd: dict[str, Any], prefix: str, _: Any) -> None:
        w = sd.pop(prefix + "wqkv")
        for name, part in zip(("wq", "wk", "wv"), w.chunk(3, dim=0)):
            sd[prefix + name] = part.clone() if mod.copy else part

    @staticmethod
    def _fuse(sd: dict[str, Any], prefix: str, *_: Any) -> None:
        if prefix + "wq" in sd:
            sd[prefix + "wqkv"] = torch.cat([sd.pop(prefix + n) for n in ("wq", "wk", "wv")])
