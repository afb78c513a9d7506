"""Domain exceptions: raised at the boundary, mapped to wire errors in one place."""

import errno


class LoraserveError(Exception):
    """Base class of every error loraserve raises on purpose."""


class FieldError(LoraserveError, ValueError):
    """Something named is wrong: `field` names the request field, setting, config field or file at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class InvalidRequestError(FieldError):
    """A request or parameter a user sent is not acceptable (400 on the wire)."""


class UnknownAdapterError(InvalidRequestError):
    """A request named an adapter that is not loaded (404 on the wire)."""

    def __init__(self, name: str, field: str = "adapter") -> None:
        super().__init__(field, f"no adapter named {name!r} is served")
        self.name = name


class ModelLoadError(LoraserveError):
    """The base model could not be found, converted or loaded."""


class ConfigError(FieldError):
    """A setting is invalid; `field` names the CLI flag (or argument) to change."""


class AdapterError(FieldError):
    """A LoRA adapter cannot be served; `field` names the config field or file at fault (422)."""


class AdapterExistsError(LoraserveError):
    """An adapter name is already taken (409 on the wire)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"adapter {name!r} already exists; delete it first or choose another name")


class AdapterRetiringError(LoraserveError):
    """A name deleted while its last requests still run cannot be reused yet (409 on the wire; retry soon)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"adapter {name!r} was removed and its last requests still run; retry in a moment")


class TenantWeightError(LoraserveError):
    """A new key's weight differs from its tenant's other keys' (409 on the wire: a tenant has one share)."""

    def __init__(self, tenant: str, weight: float) -> None:
        super().__init__(f"tenant {tenant!r} has weight {weight:g} (its other keys'): give the same")


class PayloadTooLargeError(LoraserveError):
    """An upload or archive exceeds a configured size limit (413 on the wire)."""


class InsufficientStorageError(LoraserveError):
    """The disk is full (or the quota spent): an upload cannot be stored; nothing of it is kept (507)."""


def raise_if_disk_full(error: OSError, what: str) -> None:
    """Turn ENOSPC and EDQUOT into InsufficientStorageError; leave any other OSError to the caller."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        raise InsufficientStorageError(f"no space left to {what}: {error.strerror}; free some and retry") from error


class RegistryError(LoraserveError):
    """The registry database cannot be opened, migrated or written."""


class RegistryUnavailableError(RegistryError):
    """The registry database did not answer in time; inference goes on, admin changes wait (503)."""


class AdapterNotFoundError(LoraserveError, LookupError):
    """No adapter of that name is registered (404 on the wire)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"no adapter named {name!r} is registered")


class VersionNotFoundError(LoraserveError, LookupError):
    """An adapter never had weights of that content hash (404 on the wire)."""

    def __init__(self, name: str, sha256: str) -> None:
        super().__init__(f"adapter {name!r} has no version with sha256 {sha256!r}")


class AdapterUnavailableError(LoraserveError):
    """A registered adapter could not be loaded when a request needed it (503 on the wire)."""


class ModelNotFoundError(LoraserveError, LookupError):
    """A request's `model` names neither the base model nor an adapter (404 on the wire)."""


class RequestFailedError(LoraserveError):
    """Scheduling or computing this request raised; the other requests went on (500 on the wire)."""


class ReplicaFailedError(LoraserveError):
    """A cluster's replica died (or could not be reached) while answering; Serve starts another."""


class EngineDeadError(LoraserveError):
    """The step loop stopped for good (an unrecoverable device error); no request can make progress (503)."""


class OverloadedError(LoraserveError):
    """At capacity: the request would miss its latency target; refused before any work (503, Retry-After)."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after  # seconds until the queue is predicted to have room


class QuotaExceededError(LoraserveError):
    """A tenant spent its requests or tokens per minute (429, Retry-After); `field` names the quota."""

    def __init__(self, field: str, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.field = field
        self.retry_after = retry_after  # seconds until the quota has room again


class QuotaUnavailableError(LoraserveError):
    """The cluster's quota ledger cannot be asked, and quotas fail closed: a key with a quota waits (503)."""


class ModelNotAllowedError(LoraserveError):
    """The request's API key may not use the model it names (403 on the wire)."""


class ApiKeyNotFoundError(LoraserveError, LookupError):
    """No API key of that id (404 on the wire)."""

    def __init__(self, key_id: int) -> None:
        super().__init__(f"no API key with id {key_id}")


class ClientGoneError(LoraserveError):
    """The client closed its connection before its (non-streamed) answer was ready: the request was aborted, and
    the 499 that ends it reaches no one (an answer built from the unfinished output would be no answer at all)."""


class RequestTimeoutError(LoraserveError):
    """The request waited past the timeout its client set, and was dropped unserved (504)."""
