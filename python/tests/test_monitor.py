"""DeepSpeed's monitors from the config (csv_monitor, tensorboard, wandb): engine.monitor, the lr
(and fp16's loss scale) written at each optimizer step at global_samples, and what the script
writes through engine.monitor.write_events, in DeepSpeed's file layout."""
import csv
import importlib.util

import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402

from models import batch, ds_config, make_model  # noqa: E402


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_csv_monitor_writes_deepspeeds_events_and_the_scripts(tmp_path, precision):
    cfg = ds_config(2, gas=2)
    cfg["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path), "job_name": "run"}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    engine, _, _, _ = strata.initialize(model=make_model("mlp"), config=cfg)
    assert engine.monitor.enabled
    lrs, losses = [], []
    for step in range(3):
        for micro in range(2):
            x, y = batch("mlp", step, micro)
            loss = engine(x.half() if precision == "fp16" else x, y)
            engine.backward(loss)
            engine.step()
        lrs.append(engine.get_lr()[0])
        losses.append(loss.item())
        engine.monitor.write_events([("Train/Samples/train_loss", loss.item(),
                                      engine.global_samples)])
    engine.close()
    samples = [str(8 * (s + 1)) for s in range(3)]  # micro 4 x gas 2 per step
    rows = read_csv(tmp_path / "run" / "Train_Samples_lr.csv")
    assert rows[0] == ["step", "lr"]
    assert [r[0] for r in rows[1:]] == samples
    assert [float(r[1]) for r in rows[1:]] == lrs
    rows = read_csv(tmp_path / "run" / "Train_Samples_train_loss.csv")
    assert rows[0] == ["step", "train_loss"] and [float(r[1]) for r in rows[1:]] == losses
    scale = tmp_path / "run" / "Train_Samples_loss_scale.csv"
    if precision == "fp16":
        assert [float(r[1]) for r in read_csv(scale)[1:]] == [256.0] * 3
    else:
        assert not scale.exists()


def test_no_monitor_section_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    engine, _, _, _ = strata.initialize(model=make_model("mlp"), config=ds_config(0))
    assert not engine.monitor.enabled
    engine.backward(engine(*batch("mlp", 0)))
    engine.step()
    engine.monitor.write_events([("Train/x", 1.0, 0)])  # a no-op, as DeepSpeed's
    engine.close()
    assert list(tmp_path.iterdir()) == []


def test_enabled_false_as_a_string_is_off_and_a_misspelt_key_is_named(tmp_path, monkeypatch,
                                                                        caplog):
    """"enabled": "false" is off, as DeepSpeed's bool field and strata's checker read it (it
    turned the monitor on); a misspelt key (output_dir for output_path) is warned about, where
    DeepSpeed refuses it and strata wrote to another folder without a word."""
    monkeypatch.chdir(tmp_path)
    cfg = ds_config(0)
    cfg["csv_monitor"] = {"enabled": "false", "output_path": str(tmp_path / "logs")}
    cfg["dataloader_drop_last"] = "false"
    engine, _, _, _ = strata.initialize(model=make_model("mlp"), config=cfg)
    assert not engine.monitor.enabled and not engine.dataloader_drop_last()
    engine.backward(engine(*batch("mlp", 0)))
    engine.step()
    engine.close()
    assert list(tmp_path.iterdir()) == []
    check = strata.check_config({"train_micro_batch_size_per_gpu": 1, "csv_monitor": {
        "enabled": True, "output_dir": "logs/"}, "tensorboard": {"enable": True}})
    warned = " ".join(w["text"] for w in check["warnings"])
    assert "csv_monitor.output_dir: unknown key 'output_dir'" in warned, warned
    assert "tensorboard.enable: unknown key 'enable'; did you mean 'enabled'" in warned, warned


def test_tensorboard_monitor_writes_its_event_files_or_names_the_missing_package(tmp_path):
    cfg = ds_config(2)
    cfg["tensorboard"] = {"enabled": True, "output_path": str(tmp_path), "job_name": "tb"}
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(ImportError, match="pip install tensorboard"):
            strata.initialize(model=make_model("mlp"), config=cfg)
        return
    engine, _, _, _ = strata.initialize(model=make_model("mlp"), config=cfg)
    engine.backward(engine(*batch("mlp", 0)))
    engine.step()
    engine.close()
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())

