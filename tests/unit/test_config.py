"""ScheduleConfig: one validated, frozen object from kwargs, TOML and CLI flags."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from ladle.service.cli import build_parser, config_from_args
from ladle.service.errors import ConfigError
from ladle.service.schedule import PRODUCTION_BOUNDS, ScheduleConfig


def test_defaults_are_the_production_case_with_auto_edges() -> None:
    c = ScheduleConfig()
    assert c.bucket_bounds == "auto", "edges are fitted to the dataset unless given"
    preset = ScheduleConfig.from_mapping({"bucket_bounds": " production "})  # a flag's or a TOML file's words
    assert preset.bucket_bounds == PRODUCTION_BOUNDS
    assert preset.fingerprint() == ScheduleConfig(bucket_bounds=PRODUCTION_BOUNDS).fingerprint(), (
        "the preset is its edges: the same job identity"
    )
    assert (c.max_seq_len, c.token_budget, c.max_batch_size) == (8192, 49152, 64)
    assert (c.interleave, c.rank_mode, c.overlong, c.remainder) == (
        "stride",
        "mixed",
        "truncate",
        "split",
    )


def test_frozen() -> None:
    c = ScheduleConfig()
    with pytest.raises(ValidationError):
        c.seed = 3


def test_toml_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "ladle.toml"
    path.write_text('[schedule]\nseed = 7\nrank_mode = "sync"\nbucket_bounds = [0, 100, 8193]\n')
    c = ScheduleConfig.from_toml(path, {"seed": 9})
    assert (c.seed, c.rank_mode, c.bucket_bounds) == (9, "sync", (0, 100, 8193))


@pytest.mark.parametrize(
    "config",
    [
        ScheduleConfig(),
        ScheduleConfig(bucket_bounds="auto", num_buckets=4, interleave="random", rank_mode="sync", seed=5),
    ],
)
def test_to_toml_reads_back_equal(tmp_path: Path, config: ScheduleConfig) -> None:
    path = tmp_path / "ladle.toml"
    path.write_text(config.to_toml())
    again = ScheduleConfig.from_toml(path)
    assert again == config
    assert again.fingerprint() == config.fingerprint()


def test_toml_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        ScheduleConfig.from_toml(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("seed = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        ScheduleConfig.from_toml(bad)
    typo = tmp_path / "typo.toml"
    typo.write_text("[schedule]\nseeed = 1\n")
    with pytest.raises(ConfigError) as info:
        ScheduleConfig.from_toml(typo)
    assert info.value.field == "seeed"


def test_cli_flags_build_the_same_config(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("token_budget = 16384\nmax_seq_len = 4096\nbucket_bounds = 'auto'\n")
    args = build_parser().parse_args(
        [
            "plan",
            "ds",
            "--config",
            str(path),
            "--seed",
            "5",
            "--rank-mode",
            "sync",
            "--num-buckets",
            "4",
        ]
    )
    c = config_from_args(args)
    assert c == ScheduleConfig(
        token_budget=16384,
        max_seq_len=4096,
        bucket_bounds="auto",
        seed=5,
        rank_mode="sync",
        num_buckets=4,
    )


def test_bounds_from_string() -> None:
    assert ScheduleConfig.from_mapping({"bucket_bounds": "0,10,8193"}).bucket_bounds == (
        0,
        10,
        8193,
    )
    with pytest.raises(ConfigError, match="bucket_bounds"):
        ScheduleConfig.from_mapping({"bucket_bounds": "0,ten"})


def test_budget_must_hold_one_padded_row() -> None:
    with pytest.raises(ConfigError) as info:
        ScheduleConfig.from_mapping(
            {
                "max_seq_len": 100,
                "bucket_bounds": (0, 101),
                "token_budget": 100,
                "pad_to_multiple_of": 64,
            }
        )
    assert info.value.field == "token_budget"


def test_fingerprint_stable_and_sensitive() -> None:
    a = ScheduleConfig(seed=1)
    assert a.fingerprint() == ScheduleConfig(seed=1).fingerprint()
    assert a.fingerprint() != ScheduleConfig(seed=2).fingerprint()
    assert a.fingerprint() != a.replace(rank_mode="sync").fingerprint()


def test_num_buckets_stays_in_the_identity_beside_explicit_edges() -> None:
    """Dropping it from the hash (it shapes nothing there) gave every job stored with explicit edges
    and num_buckets != their count a new fingerprint: after an upgrade, none of them resumed."""
    edges = (0, 8, 16, 32, 65)
    plain = ScheduleConfig(bucket_bounds=edges, max_seq_len=64, token_budget=512)
    other = plain.replace(num_buckets=3)
    assert plain.fingerprint() != other.fingerprint(), "stored jobs' identities would move"
    assert ScheduleConfig().fingerprint() == "db9a6849bcd574d7", "the default config's identity moved"


def test_a_job_of_an_earlier_algorithm_version_is_recognised() -> None:
    """Version 1's default config (production edges) had b60d4fea68cbcee9: a job stored with it is
    told apart from a job of another config, so the refusal can say what happened."""
    assert ScheduleConfig().planned_by("b60d4fea68cbcee9") == 1, "the old default's jobs"
    assert ScheduleConfig(bucket_bounds=PRODUCTION_BOUNDS).planned_by("b60d4fea68cbcee9") == 1
    assert ScheduleConfig(seed=1).planned_by("b60d4fea68cbcee9") is None, "another config is not"
    assert ScheduleConfig().planned_by(ScheduleConfig().fingerprint()) is None, "the current version"


def test_a_misspelt_key_gets_a_did_you_mean() -> None:
    with pytest.raises(
        ConfigError, match=r"token_budjet: is not a schedule setting; did you mean 'token_budget'"
    ):
        ScheduleConfig.from_mapping({"token_budjet": 4096})
    with pytest.raises(ConfigError) as info:
        ScheduleConfig.from_mapping({"colour": "blue"})
    assert "did you mean" not in str(info.value)
    assert "'max_seq_len'" in str(info.value)  # the settings there are
