"""DeepSpeed's small helpers that scripts import, under strata's module paths (`deepspeed` becoming
`strata`): DeepSpeed-Chat's recursive_getattr / recursive_setattr
(deepspeed.compression.helper), deepspeed.utils' RepeatingLoader, logger and log_dist, and
deepspeed.runtime.utils.see_memory_usage, each as DeepSpeed's behaves."""
import logging

import pytest

torch = pytest.importorskip("torch")
import strata as deepspeed  # noqa: E402
from strata.compression.helper import recursive_getattr, recursive_setattr  # noqa: E402
from strata.runtime.utils import see_memory_usage  # noqa: E402
from strata.utils import RepeatingLoader, log_dist, logger  # noqa: E402


def test_recursive_getattr_and_setattr_replace_a_module_by_its_dotted_name():
    """DeepSpeed-Chat's convert_linear_layer_to_lora: find each Linear by name, put a wrapper in
    its place."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sequential(torch.nn.Linear(3, 4)))
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert names == ["0", "1.0"]
    for name in names:
        inner = recursive_getattr(model, name)
        recursive_setattr(model, name, torch.nn.Sequential(inner, torch.nn.Identity()))
    assert isinstance(model[1][0], torch.nn.Sequential) and model[1][0][0].out_features == 4
    with pytest.raises(AttributeError):
        recursive_getattr(model, "1.missing")


def test_repeating_loader_starts_the_loader_again():
    loader = torch.utils.data.DataLoader(torch.arange(6), batch_size=2)
    it = RepeatingLoader(loader)
    got = [next(it).tolist() for _ in range(7)]
    assert got == [[0, 1], [2, 3], [4, 5]] * 2 + [[0, 1]]
    assert iter(it) is it


def test_logger_and_log_dist(caplog):
    assert logger.name == "DeepSpeed"
    dist = torch.distributed
    rank = dist.get_rank() if dist.is_initialized() else -1  # -1: not started, as DeepSpeed's
    with caplog.at_level(logging.INFO, logger="DeepSpeed"):
        log_dist("hello", ranks=[0])  # rank 0, or one process without torch.distributed
        log_dist("not here", ranks=[5])
    want = ["[Rank -1] hello", "[Rank -1] not here"] if rank == -1 else ["[Rank 0] hello"]
    assert [r.getMessage() for r in caplog.records] == want
    assert deepspeed.utils.log_dist is log_dist


def test_see_memory_usage_prints_only_when_forced(capsys):
    see_memory_usage("quiet")
    assert capsys.readouterr().out == ""
    see_memory_usage("after init", force=True)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "after init"
    assert out[-1].startswith("CPU Virtual Memory:  used = ") and "percent = " in out[-1]
