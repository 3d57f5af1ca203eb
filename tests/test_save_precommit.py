"""A save's ``precommit`` (``RankStateStoreAPI.save``): called once the rank's data and
state object are written and before the commit; what it raises fails the save as
raised, with nothing committed and the save's data removed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpoint_store import CheckpointStore


class Refused(Exception):
    """The caller's own refusal (a session raises FencedError there)."""


@pytest.mark.parametrize("blocking", [True, False])
def test_a_refusing_precommit_commits_nothing_and_is_raised_as_is(
        tmp_path: Path, blocking: bool) -> None:
    """When precommit runs, this save's state object is on disk and no manifest of it
    exists; its exception is the save's error unchanged (the handle's, and the call's
    when blocking); afterwards the store holds only the checkpoint before it, the
    refused save's data is gone, and the next save commits normally."""
    store = CheckpointStore(tmp_path)
    store.save({"w": torch.ones(2)}, step=1, rank_state={"n": 1}).wait()
    seen: list[tuple[list[str], list[str]]] = []

    def precommit() -> None:
        seen.append((sorted(p.name for p in (tmp_path / "manifests").glob("*.json")),
                     sorted(str(p.relative_to(tmp_path)) for p in
                            (tmp_path / "data").glob("*/ranks/0.json"))))
        raise Refused("fenced")

    if blocking:
        with pytest.raises(Refused, match="fenced"):
            store.save({"w": torch.ones(2)}, step=2, rank_state={"n": 2}, precommit=precommit)
    else:
        handle = store.save({"w": torch.ones(2)}, step=2, rank_state={"n": 2},
                            precommit=precommit, blocking=False)
        with pytest.raises(Refused, match="fenced"):
            handle.wait()
    first = store.list()
    assert [m.step for m in first] == [1]
    (manifests, objects), = seen
    assert manifests == [first[0].name]  # none of step 2 yet
    assert len(objects) == 2  # step 1's object and step 2's, written before the call
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == [first[0].uid]
    m = store.save({"w": torch.ones(2)}, step=3, rank_state={"n": 3},
                   precommit=lambda: None).wait()
    assert [x.step for x in store.list()] == [1, 3] and store.read_rank_state(m, 0) == {"n": 3}
    store.close()
