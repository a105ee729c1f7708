"""Multi-node layout: which DP ranks run on which node, the ports node 0 opens, and the CURVE keys
of the ``tcp://`` links between the nodes.

``--nnodes N`` spreads the ``--dp`` ranks evenly: node ``R`` runs global ranks
``R * dp/N .. (R + 1) * dp/N - 1`` (its local ranks ``0 .. dp/N - 1``, which are also its CUDA
devices). Node 0 runs the frontend, the engine core and its own ranks; every other node runs
``serve --headless`` (engine_core/headless.py). Everything meets on node 0, at
``--master-addr`` (A) and three ports from ``--master-port`` (P):

* ``A:P``   torch.distributed rendezvous (the TCPStore of global rank 0; gloo on CPU, NCCL on CUDA);
* ``A:P+1`` the engine core's step plans (ZMQ PUB, every rank subscribes);
* ``A:P+2`` the engine core's results link (ZMQ PULL: step results, handshakes, and a headless
  node's report of a dead worker).

The two ZMQ links use CURVE. Both keypairs are derived from the secret in ``--cluster-key-file``,
a file that every node holds (copied there by the operator, never passed on a command line): a
peer without it can neither read a plan nor inject a result. The frontend and the engine core
still talk over their private ``ipc://`` directory on node 0.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from dataclasses import dataclass, replace
from pathlib import Path

import zmq
from zmq.utils import z85

from .config import EngineConfig, EngineConfigError
from .ipc import Endpoints

log = logging.getLogger(__name__)
STORE_PORT_OFFSET = 0
STEPS_PORT_OFFSET = 1
RESULTS_PORT_OFFSET = 2
MIN_CLUSTER_KEY_CHARS = 32
KEY_HINT = "e.g. `openssl rand -hex 32 > FILE; chmod 600 FILE` on node 0, then copy FILE to every node"


@dataclass(frozen=True)
class NodeLayout:
    """Where the DP ranks run: ``nnodes`` nodes of ``ranks_per_node`` ranks, seen from ``node_rank``."""

    nnodes: int
    node_rank: int
    ranks_per_node: int

    @classmethod
    def of(cls, config: EngineConfig) -> "NodeLayout":
        return cls(config.nnodes, config.node_rank, config.dp_size // config.nnodes)

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    @property
    def world_size(self) -> int:
        return self.nnodes * self.ranks_per_node

    @property
    def local_ranks(self) -> range:
        """The global ranks this node runs."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        """A global rank's index on its node (its CUDA device there)."""
        return rank % self.ranks_per_node

    def describe_ranks(self, ranks) -> str:
        """"rank 3 (node 1)", "ranks 2, 3 (node 1), 5 (node 2)": ranks with the node each runs on."""
        by_node: dict[int, list[int]] = {}
        for rank in sorted(ranks):
            by_node.setdefault(self.node_of(rank), []).append(rank)
        parts = [f"{', '.join(map(str, node_ranks))} (node {node})" for node, node_ranks in by_node.items()]
        return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def dist_init_method(config: EngineConfig) -> str:
    """torch.distributed's rendezvous address across nodes (rank 0, on node 0, hosts the store)."""
    return f"tcp://{_host(config.master_addr)}:{config.master_port + STORE_PORT_OFFSET}"


def cluster_endpoints(config: EngineConfig, base: Endpoints | None = None) -> Endpoints:
    """``base`` (node 0's private frontend <-> engine-core links; None on a headless node, which uses
    none) with the step and result links on node 0's tcp ports, keyed from the cluster key."""
    host = _host(config.master_addr)
    server_public, server_secret, client_public, client_secret = curve_keys(read_cluster_key(config.cluster_key_file))
    links = dict(steps=f"tcp://{host}:{config.master_port + STEPS_PORT_OFFSET}",
                 results=f"tcp://{host}:{config.master_port + RESULTS_PORT_OFFSET}",
                 server_public=server_public, server_secret=server_secret,
                 client_public=client_public, client_secret=client_secret)
    if base is None:
        return Endpoints(requests="", outputs="", **links)
    return replace(base, **links)


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address  # an IPv6 literal


def read_cluster_key(path: str | None) -> bytes:
    """The shared secret of ``--cluster-key-file``; ``EngineConfigError`` (one line) if unusable."""
    if not path:
        raise EngineConfigError(f"--nnodes > 1 needs --cluster-key-file ({KEY_HINT})")
    try:
        secret = Path(path).read_bytes().strip()
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise EngineConfigError(f"--cluster-key-file {path} does not exist ({KEY_HINT})") from None
    except OSError as exc:
        raise EngineConfigError(f"--cluster-key-file {path}: {exc.strerror}") from None
    if len(secret) < MIN_CLUSTER_KEY_CHARS:
        raise EngineConfigError(f"--cluster-key-file {path} holds {len(secret)} characters, fewer than "
                                f"{MIN_CLUSTER_KEY_CHARS} ({KEY_HINT})")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("--cluster-key-file %s can be read by other users (mode %o): chmod 600 it", path,
                    stat.S_IMODE(mode))
    return secret


def curve_keys(secret: bytes) -> tuple[str, str, str, str]:
    """(server public, server secret, client public, client secret), Z85 text, the same on every node
    holding ``secret``. Any 32 bytes are a valid Curve25519 secret key; a hash of the secret with a
    role label gives one per side."""

    def keypair(role: bytes) -> tuple[str, str]:
        secret_key = z85.encode(hashlib.sha256(b"mini-deepinfer cluster " + role + b"\0" + secret).digest())
        return zmq.curve_public(secret_key).decode(), secret_key.decode()

    return (*keypair(b"server"), *keypair(b"client"))
