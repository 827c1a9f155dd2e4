"""Media types and annotation keys of the pack format, version 1 (docs/pack-format.md)."""

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_LAYOUT_VERSION = "1.0.0"

ARTIFACT_TYPE = "application/vnd.forkd.snapshot.v1"
CONFIG = "application/vnd.forkd.snapshot.config.v1+json"
MEMORY_MAP = "application/vnd.forkd.memory.map.v1+json"
MEMORY_CHUNK = "application/vnd.forkd.memory.chunk.v1+zstd"
DISK_MAP = "application/vnd.forkd.disk.map.v1+json"
DISK_CHUNK = "application/vnd.forkd.disk.chunk.v1+zstd"
VMSTATE = "application/vnd.forkd.vmstate.v1"
KERNEL = "application/vnd.forkd.kernel.v1"
INITRD = "application/vnd.forkd.initrd.v1"

# Files carried whole (one blob each), by role.
FILE_ROLES: dict[str, str] = {"vmstate": VMSTATE, "kernel": KERNEL, "initrd": INITRD}
# Images carried as a map plus chunks, by role.
IMAGE_ROLES: dict[str, tuple[str, str]] = {
    "memory": (MEMORY_MAP, MEMORY_CHUNK),
    "disk": (DISK_MAP, DISK_CHUNK),
}

ANNOTATION_PARENT_TAG = "dev.forkd.parent.tag"
ANNOTATION_COMPACTED_FROM = "dev.forkd.compacted.from"
ANNOTATION_REF_NAME = "org.opencontainers.image.ref.name"
ANNOTATION_CREATED = "org.opencontainers.image.created"
