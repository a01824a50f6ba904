"""One vocabulary for groups (refimpl/distributed/mesh.py, ``group_name``): the placements name the groups
a gradient is sharded, replicated and reduced over as the trainer's ``metrics.jsonl`` and the planner name
the bytes each group sends; a name that is not a mesh group is refused."""

from __future__ import annotations

import pytest

from refimpl.distributed.mesh import KEY_ORDER, group_name
from refimpl.distributed.placement import Box
from refimpl.parallel import placements
from refimpl.parallel.placements import Placement
from refimpl.planner.run_terms import DP_KEY, REPLICA_KEY, SHARD_KEY


def test_a_group_is_named_by_its_axes_in_key_order_whatever_order_they_come_in():
    assert group_name("cp", "dp") == group_name("dp", "cp") == "dp x cp"
    assert group_name("cp", "dp_shard") == "dp_shard x cp"
    assert [group_name(a) for a in KEY_ORDER] == list(KEY_ORDER)


@pytest.mark.parametrize("axes", [(), ("expert",), ("dp_cp",), ("dp", "expert_dp")])
def test_a_name_that_is_not_a_mesh_group_is_refused(axes):
    with pytest.raises(ValueError, match="a group is named by axes of"):
        group_name(*axes)


def test_placements_and_the_planner_use_the_mesh_names():
    assert (placements.DP, placements.DP_SHARD, placements.DP_REPLICATE) == (DP_KEY, SHARD_KEY, REPLICA_KEY)
    assert set(placements.AXES) == {"pp", "tp", "dp x cp", "dp_shard x cp", "dp_replicate", "ep", "edp"}
    with pytest.raises(ValueError, match="unknown group 'dp_cp'"):  # the old name is refused, not ignored
        Placement(box=Box.full((2,)), reduce_over=("dp_cp",))
