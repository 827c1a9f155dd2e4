"""The controller: `forkd serve` (a REST daemon owning a host's store and sandboxes) and the SDK."""
