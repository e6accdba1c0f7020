"""SkyPilot boundary of Haru: task YAML renderer and ``sky`` CLI runner (DESIGN 8).

Haru never calls a cloud API: a domain with provider ``skypilot`` is one SkyPilot cluster,
described by a :class:`TaskSpec`, rendered by :func:`render_task_yaml`, and driven by
:class:`SkyPilotDriver` through the ``sky`` CLI (argv only, time-bounded, typed errors).
Services depend on the :class:`DomainDriver` protocol so tests can inject fakes.
"""

from haru_driver_skypilot._domain import (
    SERVING_TOKEN_SECRET,
    TLS_CERT_SECRET,
    TLS_DIR,
    TLS_KEY_SECRET,
    TOKEN_SECRET,
    ModelPort,
    domain_task,
    model_ports,
    run_script,
    serving_path,
    setup_script,
    supervisor_config,
)
from haru_driver_skypilot._driver import (
    MIN_SKY_VERSION,
    TESTED_SKY_VERSION,
    DomainDriver,
    SkyApiInfo,
    SkyPilotDriver,
    resolve_sdk,
)
from haru_driver_skypilot._errors import (
    InvalidSpecError,
    SkyCliError,
    SkyCommandError,
    SkyDriverError,
    SkyOutputError,
    SkyPreflightError,
    SkySdkError,
    SkyTimeoutError,
    SkyUnavailableError,
    SkyVersionMismatchError,
    UnknownStatusError,
)
from haru_driver_skypilot._render import dump_yaml, render_task_yaml, task_config
from haru_driver_skypilot._runner import (
    SKY_ENV_DROPPED,
    SKY_ENV_NAMES,
    SKY_ENV_PREFIXES,
    SkyRunner,
    SkyTimeouts,
    is_cold_server_failure,
    sky_environment,
    strip_ansi,
    temporary_yaml,
)
from haru_driver_skypilot._sdk import (
    SDK_THREADS,
    SkyPilotSdk,
    SkySdk,
    StatusSource,
    sdk_available,
    service_record_to_mapping,
    status_record_to_mapping,
)
from haru_driver_skypilot._spec import (
    MAX_NAME_LENGTH,
    TaskSpec,
    check_name,
    cluster_name,
    is_valid_name,
    legacy_cluster_name,
)
from haru_driver_skypilot._status import (
    ClusterInfo,
    ClusterStatus,
    cluster_info_from_record,
    find_cluster,
    parse_status_json,
)
from haru_driver_skypilot._testing import (
    ExecCall,
    Reply,
    ScriptedExec,
    example_domain_layout,
    example_domain_task,
)

# Grouped by topic rather than sorted, so the public surface reads like a table of contents.
__all__ = (  # noqa: RUF022
    # Specs and names
    "TaskSpec",
    "cluster_name",
    "legacy_cluster_name",
    "check_name",
    "is_valid_name",
    "MAX_NAME_LENGTH",
    # Provisioned domains (layout to task)
    "domain_task",
    "supervisor_config",
    "model_ports",
    "ModelPort",
    "serving_path",
    "setup_script",
    "run_script",
    "TOKEN_SECRET",
    "TLS_CERT_SECRET",
    "TLS_KEY_SECRET",
    "TLS_DIR",
    "SERVING_TOKEN_SECRET",
    # Rendering
    "render_task_yaml",
    "task_config",
    "dump_yaml",
    # Runner
    "SkyRunner",
    "SkyTimeouts",
    "is_cold_server_failure",
    "sky_environment",
    "SKY_ENV_DROPPED",
    "SKY_ENV_NAMES",
    "SKY_ENV_PREFIXES",
    "strip_ansi",
    "temporary_yaml",
    # Status
    "ClusterInfo",
    "ClusterStatus",
    "cluster_info_from_record",
    "find_cluster",
    "parse_status_json",
    # Driver
    "DomainDriver",
    "SkyPilotDriver",
    "resolve_sdk",
    "SkyApiInfo",
    "MIN_SKY_VERSION",
    "TESTED_SKY_VERSION",
    # SDK (optional extra `sky`)
    "SkySdk",
    "SkyPilotSdk",
    "SDK_THREADS",
    "StatusSource",
    "sdk_available",
    "status_record_to_mapping",
    "service_record_to_mapping",
    # Errors
    "SkyDriverError",
    "InvalidSpecError",
    "SkyCommandError",
    "SkyCliError",
    "SkyTimeoutError",
    "SkyUnavailableError",
    "SkyOutputError",
    "UnknownStatusError",
    "SkySdkError",
    "SkyVersionMismatchError",
    "SkyPreflightError",
    # Test support
    "ScriptedExec",
    "Reply",
    "ExecCall",
    "example_domain_layout",
    "example_domain_task",
)
