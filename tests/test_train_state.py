"""TrainState: the train_state.pt dictionary (its keys are the on-disk format) and loading older files."""
import random

import torch
from torch.distributed.checkpoint.stateful import Stateful

from logo.train.state import TrainState

KEYS = {"step", "lr_scheduler", "data", "rng", "controller", "wandb_id", "plan", "config"}


class _Part:
    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, sd):
        self.value = sd["value"]


def _state(**kw):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    return TrainState(sched, _Part(0), _Part("fresh"), {"steps": 4}, {"model": {}}, **kw)


def test_state_dict_keys_and_round_trip():
    st = _state(step=3, wandb_id="abc")
    assert isinstance(st, Stateful)
    st.lr_scheduler.step()
    st.data.value = 7
    sd = st.state_dict()
    assert set(sd) == KEYS and sd["step"] == 3 and sd["plan"] == {"steps": 4}
    expected = random.random()
    new = _state()
    new.load_state_dict(sd)
    assert (new.step, new.wandb_id, new.data.value) == (3, "abc", 7)
    assert new.lr_scheduler.last_epoch == st.lr_scheduler.last_epoch
    assert random.random() == expected  # the RNG states were restored to the snapshot's


def test_loads_a_file_without_controller_or_wandb_id():
    sd = _state(step=2).state_dict()
    del sd["controller"], sd["wandb_id"]
    new = _state()
    new.load_state_dict(sd)
    assert (new.step, new.wandb_id, new.controller.value) == (2, None, "fresh")
