"""``BaguaEnvironment``: the cluster environment of processes started by a Bagua launcher.

``python -m bagua.distributed.launch``, ``python -m bagua.distributed.run`` and ``baguarun`` start every process
themselves and describe it with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK``,
``MASTER_ADDR``/``MASTER_PORT`` and ``BAGUA_SERVICE_PORT``; this environment reads them (through
:mod:`bagua.torch_api.env`) so that Lightning starts no processes of its own. The concrete class, which also
subclasses Lightning's ``ClusterEnvironment``, is :class:`bagua.lightning.BaguaEnvironment`.
"""

from __future__ import annotations

import logging

from bagua.torch_api import env

__all__ = ["BaguaEnvironmentBase"]

log = logging.getLogger(__name__)


class BaguaEnvironmentBase:
    """The methods of Lightning's ``ClusterEnvironment``, answered from a Bagua launcher's variables.

    Ranks and sizes are fixed by the launcher: ``set_global_rank`` and ``set_world_size`` are ignored.

    Example:
        >>> from bagua.lightning import BaguaEnvironment  # doctest: +SKIP
        >>> trainer = Trainer(strategy=BaguaStrategy(cluster_environment=BaguaEnvironment()))  # doctest: +SKIP
    """

    @property
    def creates_processes_externally(self) -> bool:
        """Always True: the Bagua launcher, not Lightning, starts the processes."""
        return True

    @property
    def main_address(self) -> str:
        """The rendezvous host (``MASTER_ADDR``, default ``127.0.0.1``)."""
        return env.get_master_addr()

    @property
    def main_port(self) -> int:
        """The rendezvous port (``MASTER_PORT``, default 29500)."""
        return env.get_master_port()

    @property
    def service_port(self) -> int:
        """``BAGUA_SERVICE_PORT``, kept for compatibility with the original (no service runs; -1 when unset)."""
        return env.get_bagua_service_port()

    @staticmethod
    def detect() -> bool:
        """Whether a Bagua launcher started this process (it always sets ``BAGUA_SERVICE_PORT``)."""
        return env.get_str("BAGUA_SERVICE_PORT") != ""

    def world_size(self) -> int:
        """``WORLD_SIZE``."""
        return env.get_world_size()

    def set_world_size(self, size: int) -> None:
        """Ignored: the launcher fixed the world size."""
        log.debug("BaguaEnvironment.set_world_size(%s) ignored; WORLD_SIZE comes from the launcher", size)

    def global_rank(self) -> int:
        """``RANK``."""
        return env.get_rank()

    def set_global_rank(self, rank: int) -> None:
        """Ignored: the launcher fixed the rank."""
        log.debug("BaguaEnvironment.set_global_rank(%s) ignored; RANK comes from the launcher", rank)

    def local_rank(self) -> int:
        """``LOCAL_RANK``."""
        return env.get_local_rank()

    def node_rank(self) -> int:
        """The node's rank (``NODE_RANK``, or ``GROUP_RANK`` under elastic launch)."""
        return env.get_node_rank()

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Raise ``ValueError`` unless the Trainer's ``devices * num_nodes`` equals the launcher's world size."""
        if num_devices * num_nodes != self.world_size():
            raise ValueError(
                f"Trainer(devices={num_devices}, num_nodes={num_nodes}) asks for {num_devices * num_nodes} "
                f"processes but the launcher started WORLD_SIZE={self.world_size()}; set devices to the number of "
                f"processes per node (LOCAL_WORLD_SIZE={env.get_local_size()}) and num_nodes to the number of nodes"
            )

    def teardown(self) -> None:
        """Nothing to release."""
