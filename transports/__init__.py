"""Moving weights from the trainer to the rollout engines, versioned and bucketed, behind one ``push``.

Transports (each bounds its extra memory to about one bucket, ``bucket_bytes``):

- `InProcessTransport` -- trainer and `EmbeddedEngine` in one process; tensors handed over by reference.
- `SharedMemoryTransport` (``shm``) -- colocated engines: a bucket travels as a shared-memory handle on
  CPU, a CUDA IPC handle on GPU (SGLang's ``update_weights_from_tensor``).
- `DistributedTransport` (``distributed``) -- a torch.distributed group from trainer rank 0 to the
  engines, gloo on CPU and NCCL on GPU (SGLang's ``init_weights_update_group`` /
  ``update_weights_from_distributed``); engines that can take a whole push in one request get it streamed,
  the bucket layout in band (transports/stream.py).
- `DiskTransport` (``disk``) -- a versioned safetensors folder written atomically, loaded by the engines
  (SGLang's ``update_weights_from_disk``).

The last three drive engines through `WeightReceiver` (SGLang's weight-update API): `InProcessReceiver`
over an in-process engine, `EngineProcess` for an engine in another process, or an SGLang client. All
map trainer names to engine names (``name_map``) and can verify the result (``check=True``).
"""

from miles_agent.transports.base import EngineTransport
from miles_agent.transports.core import (
    InProcessTransport,
    NameMap,
    WeightMismatchError,
    WeightSyncError,
    WeightTransport,
    buckets,
    prefix_map,
    tensor_checksum,
)
from miles_agent.transports.disk import DiskTransport
from miles_agent.transports.dist import DistributedTransport
from miles_agent.transports.receiver import InProcessReceiver, WeightReceiver
from miles_agent.transports.shm import SharedMemoryTransport

__all__ = [
    "DiskTransport", "DistributedTransport", "EngineTransport", "InProcessTransport", "InProcessReceiver", "NameMap",
    "SharedMemoryTransport", "WeightMismatchError", "WeightReceiver", "WeightSyncError", "WeightTransport",
    "buckets", "prefix_map", "tensor_checksum",
]
