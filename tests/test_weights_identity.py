"""A model's identity from its weight files: hashed once, remembered, and changed by any rewrite."""

from __future__ import annotations

import os

import pytest

from kvstate.interpreters.mlx import weights_identity
from kvstate.interpreters.mlx.weights_identity import weights_fingerprint
from kvstate.models.model_dir import save_model_dir


@pytest.fixture()
def model_dir(tmp_path):
    return save_model_dir(tmp_path / "model", "llama", seed=90)


def test_a_known_file_is_not_read_again(model_dir, tmp_path, monkeypatch):
    cache = tmp_path / "weights.json"
    first = weights_fingerprint(model_dir, cache)
    monkeypatch.setattr(weights_identity, "_content_hash", lambda path: pytest.fail(f"{path} read again"))
    assert weights_fingerprint(model_dir, cache) == first


def fine_tune(model_dir):
    """Flip one bit of one tensor in place, keeping the file's size and modification time."""
    weights = next(model_dir.glob("*.safetensors"))
    stat = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_any_change_to_a_weight_changes_the_identity_even_with_its_old_mtime(model_dir, tmp_path):
    cache = tmp_path / "weights.json"
    first = weights_fingerprint(model_dir, cache)
    fine_tune(model_dir)
    assert weights_fingerprint(model_dir, cache) != first


def test_another_config_is_another_identity(model_dir, tmp_path):
    cache = tmp_path / "weights.json"
    first = weights_fingerprint(model_dir, cache)
    (model_dir / "config.json").write_text((model_dir / "config.json").read_text().replace("8192", "4096"))
    assert weights_fingerprint(model_dir, cache) != first


def test_a_directory_without_weight_files_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="safetensors"):
        weights_fingerprint(tmp_path, tmp_path / "weights.json")


def test_a_cache_that_cannot_be_written_costs_only_a_hash(model_dir, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    assert weights_fingerprint(model_dir, blocked / "weights.json") == weights_fingerprint(model_dir,
                                                                                        tmp_path / "w.json")


def test_the_first_hash_of_the_weights_is_said_with_progress_and_a_known_one_not(model_dir, tmp_path, caplog):
    import logging

    cache = tmp_path / "weights.json"
    with caplog.at_level(logging.INFO):
        weights_fingerprint(model_dir, cache)
        first = [r.getMessage() for r in caplog.records]
        caplog.clear()
        weights_fingerprint(model_dir, cache)
    files = len(list(model_dir.glob("*.safetensors")))
    assert any(m.startswith(f"kvstate: hashing {files} weight files") for m in first)
    assert sum(m.startswith("kvstate: hashed ") and f"of {files}," in m for m in first) == files
    assert not [r for r in caplog.records if "hash" in r.getMessage()]
