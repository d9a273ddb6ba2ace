"""``LadleTrainer``: Hugging Face's ``Trainer`` on a real server's batches, alone and under torchrun.

Every batch a training step took is compared, by a digest of its
``input_ids``, with the rank's stream read straight from the server by a
plain ``BatchClient`` on another job (the schedule does not depend on the
job's name): across epochs, across a resume from a checkpoint, and on two
DDP ranks.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from ladle.client import BatchClient
from ladle.client.errors import BatchClientError
from ladle.client.hf import LadleTrainer, model_inputs, state_file
from ladle.service.synth import make_dataset
from tests.integration import hf_trainer_proc
from tests.integration.hf_trainer_proc import VOCAB, digest, run
from tests.support.session import run_in_session

PROC = Path(hf_trainer_proc.__file__)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 22 batches an epoch on one rank: a two-epoch run is quick."""
    out = tmp_path_factory.mktemp("hf-ds") / "ds"
    make_dataset(out, 300, seed=5, scale=1 / 16, vocab_size=VOCAB)
    return out


@pytest.fixture
def server(server_factory: Callable[..., Any], dataset: Path) -> Any:
    return server_factory(dataset=dataset)


def stream(server: Any, rank: int, world: int, batches: int) -> list[str]:
    """The first ``batches`` of the rank's stream across epochs, as ``model_inputs`` digests."""
    got: list[str] = []
    with BatchClient(rank, world, server.address, f"reference-{rank}-of-{world}", timeout=30) as client:
        while len(got) < batches:
            before = len(got)
            for batch in client:
                got.append(digest(model_inputs(batch)["input_ids"]))
                if len(got) == batches:
                    break
            assert len(got) > before, "an empty epoch"
    return got


def trained(out: Path, rank: int = 0) -> list[str]:
    lines = (out / f"rank-{rank}.jsonl").read_text().splitlines()
    return [json.loads(line)["digest"] for line in lines]


def test_two_epochs_train_on_the_stream_with_none_skipped_or_repeated(server: Any, tmp_path: Path) -> None:
    """Trainer's epochs are epoch 0's length; ladle's differ by a few batches, and the seams lose none."""
    result = run(server.address, "epochs", tmp_path, epochs=2, accumulate=3)
    length = result["length"]
    assert length > 10
    expected = stream(server, 0, 1, 2 * length)
    assert trained(tmp_path) == expected, "Trainer trained on other batches than the rank's stream"
    assert result["global_step"] == 2 * -(-length // 3)  # the last update of an epoch takes the rest
    assert result["state"]["epoch"] >= 1, "the second epoch was not reached"


@pytest.mark.parametrize(("accumulate", "ignore_data_skip"), [(1, False), (2, False), (2, True)])
def test_a_resumed_run_trains_as_an_uninterrupted_one(
    server: Any, tmp_path: Path, accumulate: int, ignore_data_skip: bool
) -> None:
    """Same batches, same losses: the checkpoint's position is loaded, and Trainer does not skip again.

    ``ignore_data_skip`` is how a transformers without ``get_resumed_dataloader`` runs.
    """
    whole = run(server.address, "resume", tmp_path / "whole", max_steps=8, accumulate=accumulate,
                save_steps=3)  # fmt: skip
    checkpoint = tmp_path / "whole" / "checkpoints" / "checkpoint-3"
    assert json.loads(state_file(checkpoint, 0).read_text())["step"] == 3 * accumulate
    resumed = run(server.address, "resume", tmp_path / "resumed", max_steps=8, accumulate=accumulate,
                  resume=str(checkpoint), ignore_data_skip=ignore_data_skip)  # fmt: skip
    assert trained(tmp_path / "resumed") == trained(tmp_path / "whole")[3 * accumulate :], (
        "the resumed run trained on other batches than the uninterrupted run after its checkpoint"
    )
    for step in range(4, 9):
        assert resumed["losses"][str(step)] == pytest.approx(whole["losses"][str(step)], rel=1e-4), step
    assert resumed["state"] == whole["state"]


def test_resume_from_the_last_checkpoint(server: Any, tmp_path: Path) -> None:
    run(server.address, "last", tmp_path, max_steps=4, save_steps=2)
    more = run(server.address, "last", tmp_path, max_steps=6, resume="last")  # from checkpoint-4
    assert more["global_step"] == 6
    assert trained(tmp_path) == stream(server, 0, 1, 6), "the two runs together are not one stream"


def test_a_checkpoint_without_a_position_goes_on_from_the_cursor_with_a_warning(
    server: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint saved by a plain Trainer: the stored cursor is all there is, and the log says so."""
    run(server.address, "no-position", tmp_path / "first", max_steps=4, save_steps=2)
    checkpoint = tmp_path / "checkpoint-2"
    shutil.copytree(tmp_path / "first" / "checkpoints" / "checkpoint-2", checkpoint)
    state_file(checkpoint, 0).unlink()
    with caplog.at_level(logging.WARNING, logger="ladle.client.hf"):
        run(server.address, "no-position", tmp_path / "second", max_steps=4, resume=str(checkpoint))
    assert "has no ladle position for rank 0" in caplog.text
    assert trained(tmp_path / "second") == stream(server, 0, 1, 6)[4:], "not from the cursor on"


def test_a_corrupt_position_is_a_clear_error(server: Any, tmp_path: Path) -> None:
    run(server.address, "corrupt", tmp_path / "first", max_steps=2, save_steps=2)
    checkpoint = tmp_path / "first" / "checkpoints" / "checkpoint-2"
    state_file(checkpoint, 0).write_text('{"version": 1, "job": "corr')
    with pytest.raises(BatchClientError, match="is not a ladle position"):
        run(server.address, "corrupt", tmp_path / "second", max_steps=4, resume=str(checkpoint))


def tiny_trainer(tmp_path: Path, auto_find_batch_size: bool = False, **kwargs: Any) -> LadleTrainer:
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1)  # fmt: skip
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                             auto_find_batch_size=auto_find_batch_size)  # fmt: skip
    return LadleTrainer(model=LlamaForCausalLM(config), args=args, **kwargs)


def test_a_client_of_another_rank_or_world_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BatchClientError, match=r"rank 1 of 2, but this process is rank 0 of 1"):
        tiny_trainer(tmp_path, client=BatchClient(1, 2, "127.0.0.1:1", "other-rank"))


@pytest.mark.parametrize(("given", "match"), [("train_dataset", "not both"), ("data_collator", "leave out")])
def test_a_dataset_beside_a_client_or_a_collator_is_refused(tmp_path: Path, given: str, match: str) -> None:
    extra: dict[str, Any] = {given: object()}
    with pytest.raises(TypeError, match=match):
        tiny_trainer(tmp_path, client=BatchClient(0, 1, "127.0.0.1:1", "given"), **extra)


def test_auto_find_batch_size_is_refused(tmp_path: Path) -> None:
    """Its retry after an out-of-memory error would go on past the batches of the failed run."""
    with pytest.raises(ValueError, match="serve a smaller --token-budget"):
        tiny_trainer(tmp_path, auto_find_batch_size=True, client=BatchClient(0, 1, "127.0.0.1:1", "auto"))


def test_hyperparameter_trials_are_refused_before_any_trial_reads(tmp_path: Path) -> None:
    """Trials would share one stream (each reading on past the last), positions outside their folders."""
    # no server there: a trial that began reading would raise ServerUnavailableError instead
    trainer = tiny_trainer(tmp_path, client=BatchClient(0, 1, "127.0.0.1:1", "trials", timeout=5))
    with pytest.raises(NotImplementedError, match="a LadleTrainer of its own with a client of its own job"):
        trainer.hyperparameter_search(n_trials=2)
    with pytest.raises(NotImplementedError, match="share one ladle stream"):
        trainer.train(trial={"learning_rate": 1e-3})


def test_a_rank_of_a_larger_world_loads_rank_0s_position(
    server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint of one rank, resumed by two: rank 1 loads rank 0's position, not the job's cursor.

    In one process, so it does not depend on which rank opens its stream first (under torchrun,
    below, the first rank's load re-plans the job, and a rank that came second would start there
    even without a position).
    """
    with BatchClient(0, 1, server.address, "grow", timeout=30) as client:
        for _, _batch in zip(range(5), client, strict=False):
            pass
        state = client.state_dict()
        for _, _batch in zip(range(3), client, strict=False):
            pass  # the job's cursor goes on past the checkpoint
    checkpoint = tmp_path / "checkpoint-5"
    checkpoint.mkdir()
    state_file(checkpoint, 0).write_text(json.dumps(state))
    first = BatchClient(0, 1, server.address, "grow", elastic=True)
    trainer = tiny_trainer(tmp_path, client=first)
    first.close()
    with BatchClient(1, 2, server.address, "grow", timeout=30, elastic=True) as grown:
        trainer.ladle = grown
        monkeypatch.setattr(type(trainer.args), "process_index", property(lambda _args: 1))
        trainer._load_position(checkpoint)
        assert grown.position == (state["epoch"], state["step"]) == (0, 5)


def torchrun(server: Any, out: Path, *args: str, elastic: bool = False) -> None:
    """Two ranks, each with the client LadleTrainer makes from the environment, as a launcher gives it.

    ``elastic``: each with an elastic client of its own (``LadleTrainer``'s is not).
    """
    given = [server.address, "ddp", str(out), "--elastic"] if elastic else ["env", "-", str(out)]
    cmd = [
        "env", f"LADLE_SERVER={server.address}", "LADLE_JOB=ddp",
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(PROC), *given, *args,
    ]  # fmt: skip
    code, output = run_in_session(cmd, timeout=240)
    (out.parent / f"{out.name}.log").write_text(output)
    assert code == 0, f"torchrun failed (all of it in {out.name}.log):\n{output[-4000:]}"


def test_two_ddp_ranks_under_torchrun_train_on_their_streams_and_resume(server: Any, tmp_path: Path) -> None:
    steps = ["--max-steps", "5", "--accumulate", "2"]
    torchrun(server, tmp_path / "whole", *steps, "--save-steps", "2")
    checkpoint = tmp_path / "whole" / "checkpoints" / "checkpoint-2"
    torchrun(server, tmp_path / "resumed", *steps, "--resume", str(checkpoint), "--save-steps", "5")
    for rank in range(2):
        expected = stream(server, rank, 2, 10)
        assert trained(tmp_path / "whole", rank) == expected, f"rank {rank}: other batches than its stream"
        assert trained(tmp_path / "resumed", rank) == expected[4:], f"rank {rank}: the resume is not exact"
        position = json.loads(state_file(checkpoint, rank).read_text())
        assert (position["rank"], position["world_size"], position["step"]) == (rank, 2, 4)

    # the job goes on with one rank from the two ranks' last checkpoint: the rest of the epoch is
    # re-planned for one rank, as for plain clients that went the same way on a job of their own
    last = tmp_path / "resumed" / "checkpoints" / "checkpoint-5"
    alone = run(server.address, "ddp", tmp_path / "alone", max_steps=13, resume=str(last), elastic=True,
                save_steps=2)  # checkpoints at 6, 8, 10, 12 and the last, 13  # fmt: skip
    assert alone["state"]["world_size"] == 1
    alone_expected, state = elastic_reference(server, [states_at(server, 10)], 1, batches=7)
    assert trained(tmp_path / "alone")[:7] == alone_expected[0], (
        "one rank resumed from two ranks' checkpoint trained on other batches than the re-planned stream"
    )
    # and back to two ranks from the one rank's checkpoint of a step before it stopped: rank 1
    # has no position of its own there, so it loads rank 0's, as every rank of a larger world may
    # (the job's cursor, a batch on, is not where the checkpoint is)
    last = tmp_path / "alone" / "checkpoints" / "checkpoint-12"
    assert not state_file(last, 1).exists()
    torchrun(server, tmp_path / "again", "--max-steps", "15", "--resume", str(last), elastic=True)
    again_expected, _ = elastic_reference(server, [state, state], 2, batches=3)
    for rank in range(2):
        assert trained(tmp_path / "again", rank) == again_expected[rank], f"rank {rank} after growing"


REFERENCE_ELASTIC = "reference-elastic"


def states_at(server: Any, steps: int) -> dict[str, Any]:
    """Two plain clients read ``steps`` batches each on the reference job; rank 0's state."""
    states = []
    for rank in range(2):
        with BatchClient(rank, 2, server.address, REFERENCE_ELASTIC, timeout=30) as client:
            for _, _batch in zip(range(steps), client, strict=False):
                pass
            states.append(client.state_dict())
    assert [(s["epoch"], s["step"]) for s in states] == [(0, steps), (0, steps)]
    return states[0]


def elastic_reference(
    server: Any, states: list[dict[str, Any]], world: int, batches: int
) -> tuple[list[list[str]], dict[str, Any]]:
    """Each rank of an elastic world loads its state and reads ``batches``; and rank 0's state after."""
    got: list[list[str]] = []
    after: dict[str, Any] = {}
    clients = [
        BatchClient(rank, world, server.address, REFERENCE_ELASTIC, timeout=30, elastic=True)
        for rank in range(world)
    ]
    try:
        for client, state in zip(clients, states, strict=True):
            client.load_state_dict(state)
        for client in clients:
            mine: list[str] = []
            while len(mine) < batches:
                wanted = range(batches - len(mine))  # zip stops before taking a batch too many
                mine += [digest(model_inputs(b)["input_ids"]) for _, b in zip(wanted, client, strict=False)]
            got.append(mine)
        after = clients[0].state_dict()
    finally:
        for client in clients:
            client.close()
    return got, after
