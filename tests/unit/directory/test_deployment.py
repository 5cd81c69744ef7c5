"""The Directory refuses to run beside another replica: its live requests must be in one place."""

from __future__ import annotations

import pytest
from ray.serve._private.config import DeploymentConfig

from stages.directory.deployment import DirectoryReplicasError, refuse_more_than_one


def test_one_replica_is_accepted() -> None:
    refuse_more_than_one(DeploymentConfig(num_replicas=1))
    refuse_more_than_one(DeploymentConfig(autoscaling_config={"min_replicas": 1, "max_replicas": 1}))


@pytest.mark.parametrize("config,setting", [
    (DeploymentConfig(num_replicas=2), "num_replicas: 2"),
    (DeploymentConfig(autoscaling_config={"min_replicas": 1, "max_replicas": 3}), "autoscaling_config.max_replicas: 3"),
])
def test_more_than_one_is_refused_naming_the_setting(config: DeploymentConfig, setting: str) -> None:
    with pytest.raises(DirectoryReplicasError, match="must run exactly one replica") as err:
        refuse_more_than_one(config)
    assert setting in str(err.value)
