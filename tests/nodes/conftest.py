"""tests/nodes: jobs whose ranks run on two pretend nodes of this machine (local_nodes.py). Every test here
skips, with the reason, where the machine cannot play two nodes (not root, no working `unshare --uts`);
`two_nodes` starts jobs there (`.train(out, sets)`; with local_nodes.wait_ranks, the pid and host of every
rank, e.g. to kill one) and kills whatever a test leaves behind."""
from __future__ import annotations

import pytest
from local_nodes import TwoNodes, namespaces_unusable


@pytest.fixture(scope="session", autouse=True)     # before any module-scoped job starts
def _need_namespaces():
    why = namespaces_unusable()
    if why:
        pytest.skip(why)


@pytest.fixture
def two_nodes():
    job = TwoNodes()
    try:
        yield job
    finally:
        job.kill_all()
