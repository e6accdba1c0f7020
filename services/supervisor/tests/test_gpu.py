"""GPU memory: the nvidia-smi parser on real H200 captures, the sources, and the route."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from haru_exec import ExecResult, ExecSpawnError, ExecTimeoutError
from haru_protocol import GpuMemory, GpuProcess
from haru_supervisor.api import (
    NVIDIA_SMI_APPS_ARGS,
    NVIDIA_SMI_ARGS,
    NVIDIA_SMI_UUID_ARGS,
    SOURCE_HEADER,
    GpuMemorySourceError,
    GpuMemoryUnavailable,
    NvidiaSmiSource,
    NvmlSource,
    open_gpu_reader,
    parse_nvidia_smi_apps,
    parse_nvidia_smi_memory,
    parse_nvidia_smi_uuids,
    process_name,
)

MIB = 1024 * 1024

INFERENCE_ONLY = {
    "slots": [{"kind": "inference", "gpuIndex": 0, "models": [{"name": "m", "port": 9}]}]
}


# -- parser ------------------------------------------------------------------------------------


def test_parses_the_real_idle_h200_capture(data_dir: Path) -> None:
    text = (data_dir / "smi-mem.csv").read_text()
    assert parse_nvidia_smi_memory(text) == (GpuMemory(index=0, used_mib=0, total_mib=143771),)


def test_parses_a_gpu_holding_memory(data_dir: Path) -> None:
    text = (data_dir / "smi-mem-holding-20gib.csv").read_text()
    (gpu,) = parse_nvidia_smi_memory(text)
    assert (gpu.used_mib, gpu.total_mib) == (21714, 143771)


def test_parses_several_gpus_and_ignores_blank_lines() -> None:
    text = "0, 0, 81559\n\n1, 40210, 81559\r\n 2 ,12.5, 81559 \n"
    assert [(g.index, g.used_mib, g.total_mib) for g in parse_nvidia_smi_memory(text)] == [
        (0, 0, 81559),
        (1, 40210, 81559),
        (2, 12.5, 81559),
    ]


def test_mig_not_available_is_an_error(data_dir: Path) -> None:
    with pytest.raises(GpuMemorySourceError, match=r"not numeric.*\[N/A\]"):
        parse_nvidia_smi_memory((data_dir / "smi-mem-mig.csv").read_text())


def test_header_and_units_capture_is_refused(data_dir: Path) -> None:
    # The real capture with a header and units has seven columns: a drifted query.
    with pytest.raises(GpuMemorySourceError, match="line 1 has 7 columns"):
        parse_nvidia_smi_memory((data_dir / "smi-mem-header.csv").read_text())


def test_the_default_table_is_refused(data_dir: Path) -> None:
    with pytest.raises(GpuMemorySourceError, match="line 1"):
        parse_nvidia_smi_memory((data_dir / "smi-default.txt").read_text())


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("0, 0\n", "2 columns"),
        ("0, 0, 143771, 616\n", "4 columns"),
        ("0, 0 MiB, 143771 MiB\n", "not numeric"),
        ("GPU-811a34c2, 0, 143771\n", "not numeric"),
        ("0, -5, 143771\n", "not numeric"),
        ("0, 0, 143771\n0, 1, 143771\n", "GPU 0 twice"),
        ("", "no GPU"),
        ("\n  \n", "no GPU"),
        ("0, , 143771\n", "not numeric"),
    ],
)
def test_malformed_output_is_an_error(text: str, match: str) -> None:
    with pytest.raises(GpuMemorySourceError, match=match):
        parse_nvidia_smi_memory(text)


def test_the_error_message_is_bounded() -> None:
    with pytest.raises(GpuMemorySourceError) as caught:
        parse_nvidia_smi_memory("0, " + "x" * 100_000 + ", 1\n")
    assert len(str(caught.value)) < 300


# -- nvidia-smi through an injected exec ---------------------------------------------------------


@dataclass
class FakeExec:
    """Answers like ``run_exec``; records each call."""

    stdout: str = ""
    returncode: int = 0
    stderr: str = ""
    raises: Exception | None = None
    calls: list[tuple[tuple[str, ...], float]] = field(default_factory=list)

    async def __call__(
        self, argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None
    ) -> ExecResult:
        self.calls.append((tuple(argv), timeout))
        if self.raises is not None:
            raise self.raises
        return ExecResult(
            argv=tuple(argv), returncode=self.returncode, stdout=self.stdout, stderr=self.stderr
        )


async def test_nvidia_smi_runs_the_exact_argv_with_a_bound(data_dir: Path) -> None:
    fake = FakeExec(stdout=(data_dir / "smi-mem.csv").read_text())
    source = NvidiaSmiSource("/usr/bin/nvidia-smi", exec_=fake)
    assert await source.read() == (GpuMemory(index=0, used_mib=0, total_mib=143771),)
    ((argv, timeout),) = fake.calls
    assert argv == (
        "/usr/bin/nvidia-smi",
        "--query-gpu=index,memory.used,memory.total",
        "--format=csv,noheader,nounits",
    )
    assert argv[1:] == NVIDIA_SMI_ARGS
    assert 0 < timeout <= 10


@pytest.mark.parametrize(
    ("fake", "match"),
    [
        (
            FakeExec(returncode=9, stderr="NVIDIA-SMI has failed because it couldn't communicate"),
            "exited with status 9: NVIDIA-SMI has failed",
        ),
        (
            FakeExec(
                raises=ExecTimeoutError("'nvidia-smi' did not finish", argv=("x",), timeout=5)
            ),
            "did not finish",
        ),
        (FakeExec(raises=ExecSpawnError("cannot run 'nvidia-smi'", argv=("x",))), "cannot run"),
        (FakeExec(stdout="0, [N/A], [N/A]\n"), r"\[N/A\]"),
    ],
)
async def test_nvidia_smi_failures_are_source_errors(fake: FakeExec, match: str) -> None:
    with pytest.raises(GpuMemorySourceError, match=match):
        await NvidiaSmiSource("nvidia-smi", exec_=fake).read()


# -- NVML through a fake binding ---------------------------------------------------------------


class FakeNvmlError(Exception):
    pass


@dataclass
class Memory:
    total: int
    used: int
    reserved: int = 0


@dataclass
class FakeNvml:
    """The pynvml surface the supervisor uses: v1 counts reserved memory as used, v2 not."""

    gpus: list[tuple[int, int, int]] = field(default_factory=lambda: [(0, 616 * MIB, 143771 * MIB)])
    has_v2: bool = True
    init_fails: bool = False
    read_fails: bool = False
    shutdowns: int = 0
    NVMLError: type[Exception] = FakeNvmlError

    @property
    def nvmlMemory_v2(self) -> int:  # noqa: N802
        if not self.has_v2:
            raise AttributeError("nvmlMemory_v2")
        return 0x02000028

    def nvmlInit(self) -> None:  # noqa: N802
        if self.init_fails:
            raise FakeNvmlError("Driver Not Loaded")

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> object:  # noqa: N802
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: object, version: int | None = None) -> Memory:  # noqa: N802
        if self.read_fails:
            raise FakeNvmlError("GPU is lost")
        assert isinstance(handle, int)
        used, reserved, total = self.gpus[handle]
        if version is None:
            return Memory(total=total, used=used + reserved)
        if not self.has_v2:
            raise FakeNvmlError("Function Not Found")
        assert version == 0x02000028
        return Memory(total=total, used=used, reserved=reserved)


async def test_nvml_v2_excludes_reserved_memory_like_nvidia_smi() -> None:
    fake = FakeNvml(gpus=[(0, 616 * MIB, 143771 * MIB), (21714 * MIB, 616 * MIB, 143771 * MIB)])
    source = NvmlSource.open(fake)
    assert source.name == "nvml-v2"
    assert await source.read() == (
        GpuMemory(index=0, used_mib=0, total_mib=143771),
        GpuMemory(index=1, used_mib=21714, total_mib=143771),
    )
    source.close()
    source.close()
    assert fake.shutdowns == 1


async def test_nvml_without_v2_falls_back_to_v1_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeNvml(has_v2=False)
    source = NvmlSource.open(fake)
    assert source.name == "nvml-v1"
    (gpu,) = await source.read()
    assert gpu.used_mib == 616  # v1: reserved memory counted as used
    assert "INCLUDES driver-reserved memory" in caplog.text


def test_nvml_init_failure_is_unavailable() -> None:
    with pytest.raises(GpuMemoryUnavailable, match="Driver Not Loaded"):
        NvmlSource.open(FakeNvml(init_fails=True))


def test_nvml_with_no_gpu_is_unavailable_and_shut_down() -> None:
    fake = FakeNvml(gpus=[])
    with pytest.raises(GpuMemoryUnavailable, match="no GPU"):
        NvmlSource.open(fake)
    assert fake.shutdowns == 1


async def test_nvml_read_failure_is_a_source_error() -> None:
    fake = FakeNvml()
    source = NvmlSource.open(fake)
    fake.read_fails = True
    with pytest.raises(GpuMemorySourceError, match="GPU is lost"):
        await source.read()


# -- source selection ----------------------------------------------------------------------------


def _fake_smi(directory: Path, capture: Path | None, *, exit_code: int = 0) -> Path:
    """A ``nvidia-smi`` executable that prints ``capture`` and records its argv."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "nvidia-smi"
    body = f"sys.stdout.write(open({str(capture)!r}).read())\n" if capture else ""
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"open({str(directory / 'argv.txt')!r}, 'w').write(' '.join(sys.argv[1:]))\n"
        f"{body}"
        f"sys.exit({exit_code})\n"
    )
    script.chmod(0o755)
    return script


async def test_auto_prefers_nvml() -> None:
    reader = await open_gpu_reader("auto", nvml_loader=FakeNvml, search_path="")
    assert reader.source is not None
    assert reader.source.name == "nvml-v2"
    reader.close()


async def test_auto_falls_back_to_nvidia_smi_on_path(tmp_path: Path, data_dir: Path) -> None:
    smi = _fake_smi(tmp_path / "bin", data_dir / "smi-mem.csv")
    reader = await open_gpu_reader(
        "auto", nvml_loader=lambda: FakeNvml(init_fails=True), search_path=str(smi.parent)
    )
    assert reader.source is not None
    assert reader.source.name == "nvidia-smi"
    assert await reader.read() == (GpuMemory(index=0, used_mib=0, total_mib=143771),)
    assert (tmp_path / "bin" / "argv.txt").read_text() == " ".join(NVIDIA_SMI_ARGS)


async def test_forced_nvidia_smi_skips_nvml(tmp_path: Path, data_dir: Path) -> None:
    smi = _fake_smi(tmp_path / "bin", data_dir / "smi-mem.csv")
    reader = await open_gpu_reader("nvidia-smi", nvml_loader=FakeNvml, search_path=str(smi.parent))
    assert reader.source is not None
    assert reader.source.name == "nvidia-smi"


async def test_forced_nvml_never_falls_back(tmp_path: Path, data_dir: Path) -> None:
    smi = _fake_smi(tmp_path / "bin", data_dir / "smi-mem.csv")
    reader = await open_gpu_reader("nvml", nvml_loader=lambda: None, search_path=str(smi.parent))
    assert reader.source is None
    with pytest.raises(GpuMemoryUnavailable, match="NVML bindings are not installed"):
        await reader.read()


async def test_neither_source_is_unavailable() -> None:
    reader = await open_gpu_reader("auto", nvml_loader=lambda: None, search_path="")
    with pytest.raises(GpuMemoryUnavailable, match="nvidia-smi is not on PATH"):
        await reader.read()


# -- the route -------------------------------------------------------------------------------


async def test_route_reads_a_fake_nvidia_smi_on_path(
    supervisor: Any, auth: dict[str, str], tmp_path: Path, data_dir: Path
) -> None:
    smi = _fake_smi(tmp_path / "bin", data_dir / "smi-mem-holding-20gib.csv")
    client = await supervisor(INFERENCE_ONLY, search_path=str(smi.parent))
    response = await client.get("/v1/gpu/memory", headers=auth)
    assert response.status == 200
    assert response.headers[SOURCE_HEADER] == "nvidia-smi"
    assert await response.json() == {
        "gpus": [{"index": 0, "usedMiB": 21714.0, "totalMiB": 143771.0}]
    }


@pytest.mark.parametrize("capture", ["smi-mem-mig.csv", "smi-mem-header.csv"])
async def test_route_answers_502_on_a_bad_line(
    supervisor: Any, auth: dict[str, str], tmp_path: Path, data_dir: Path, capture: str
) -> None:
    smi = _fake_smi(tmp_path / "bin", data_dir / capture)
    client = await supervisor(INFERENCE_ONLY, search_path=str(smi.parent))
    response = await client.get("/v1/gpu/memory", headers=auth)
    assert response.status == 502
    error = (await response.json())["error"]
    assert error["code"] == "upstream_unreachable"
    assert "nvidia-smi line 1" in error["message"]
    assert len(error["message"]) < 400


async def test_route_answers_502_when_nvidia_smi_fails(
    supervisor: Any, auth: dict[str, str], tmp_path: Path
) -> None:
    smi = _fake_smi(tmp_path / "bin", None, exit_code=9)
    client = await supervisor(INFERENCE_ONLY, search_path=str(smi.parent))
    response = await client.get("/v1/gpu/memory", headers=auth)
    assert response.status == 502
    assert "exited with status 9" in (await response.json())["error"]["message"]


async def test_route_answers_501_without_a_source(supervisor: Any, auth: dict[str, str]) -> None:
    client = await supervisor(INFERENCE_ONLY, search_path="")
    response = await client.get("/v1/gpu/memory", headers=auth)
    assert response.status == 501
    assert (await response.json())["error"]["code"] == "not_implemented"


async def test_route_uses_an_injected_exec(
    supervisor: Any, auth: dict[str, str], tmp_path: Path, data_dir: Path
) -> None:
    smi = _fake_smi(tmp_path / "bin", None)
    fake = FakeExec(stdout="0, 10, 100\n1, 20, 100\n")
    client = await supervisor(
        INFERENCE_ONLY, search_path=str(smi.parent), exec_=fake, gpu_source="nvidia-smi"
    )
    response = await client.get("/v1/gpu/memory", headers=auth)
    assert response.status == 200
    assert [gpu["usedMiB"] for gpu in (await response.json())["gpus"]] == [10, 20]
    assert fake.calls[0][0] == (str(smi), *NVIDIA_SMI_ARGS)


# -- compute processes: who holds the memory -------------------------------------------------

UUID_H200 = "GPU-811a34c2-3b4b-7d57-9ef5-adf2f887d9ae"


def test_parses_the_real_apps_capture_of_a_process_holding_20_gib(data_dir: Path) -> None:
    uuids = parse_nvidia_smi_uuids((data_dir / "smi-index-uuid.csv").read_text())
    assert uuids == {UUID_H200: 0}
    apps = parse_nvidia_smi_apps((data_dir / "smi-apps-holding-20gib.csv").read_text(), uuids)
    assert apps == {0: (GpuProcess(pid=431, name=process_name(431), used_mib=21090.0),)}


def test_the_real_idle_apps_capture_is_empty(data_dir: Path) -> None:
    assert (data_dir / "smi-apps-idle.csv").read_text() == ""
    assert parse_nvidia_smi_apps("", {UUID_H200: 0}) == {}


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("431, GPU-other, 21090\n", "unknown GPU"),
        ("431, 21090\n", "is not 'pid, gpu_uuid, used_memory'"),
        ("x, GPU-811a34c2-3b4b-7d57-9ef5-adf2f887d9ae, 1\n", "is not 'pid"),
    ],
)
def test_malformed_apps_output_is_an_error(text: str, match: str) -> None:
    with pytest.raises(GpuMemorySourceError, match=match):
        parse_nvidia_smi_apps(text, {UUID_H200: 0})


@dataclass
class ArgvExec:
    """Answers each nvidia-smi query from its own text."""

    answers: dict[str, str]
    calls: list[tuple[str, ...]] = field(default_factory=list)

    async def __call__(
        self, argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None
    ) -> ExecResult:
        self.calls.append(tuple(argv))
        return ExecResult(argv=tuple(argv), returncode=0, stdout=self.answers[argv[1]], stderr="")


async def test_the_processes_route_names_who_holds_each_gpu(
    supervisor: Any, auth: dict[str, str], tmp_path: Path, data_dir: Path
) -> None:
    smi = _fake_smi(tmp_path / "bin", None)
    # The real capture, with this test's own pid so that its name can be read.
    holding = (data_dir / "smi-apps-holding-20gib.csv").read_text().replace("431", str(os.getpid()))
    fake = ArgvExec(
        {
            NVIDIA_SMI_ARGS[0]: (data_dir / "smi-mem-holding-20gib.csv").read_text(),
            NVIDIA_SMI_APPS_ARGS[0]: holding,
            NVIDIA_SMI_UUID_ARGS[0]: (data_dir / "smi-index-uuid.csv").read_text(),
        }
    )
    client = await supervisor(
        INFERENCE_ONLY, search_path=str(smi.parent), exec_=fake, gpu_source="nvidia-smi"
    )
    response = await client.get("/v1/gpu/processes", headers=auth)
    assert response.status == 200
    (gpu,) = (await response.json())["gpus"]
    name = process_name(os.getpid())
    assert name
    assert gpu["processes"] == [{"pid": os.getpid(), "name": name, "usedMiB": 21090.0}]
    # The uuid map is asked once, then reused.
    await client.get("/v1/gpu/processes", headers=auth)
    assert sum(call[1] == NVIDIA_SMI_UUID_ARGS[0] for call in fake.calls) == 1
    # The memory route is unchanged: one query, no process list.
    fake.calls.clear()
    memory = await (await client.get("/v1/gpu/memory", headers=auth)).json()
    assert "processes" not in memory["gpus"][0]
    assert [call[1] for call in fake.calls] == [NVIDIA_SMI_ARGS[0]]


async def test_the_processes_route_answers_502_when_the_listing_fails(
    supervisor: Any, auth: dict[str, str], tmp_path: Path, data_dir: Path
) -> None:
    smi = _fake_smi(tmp_path / "bin", None)
    fake = ArgvExec(
        {
            NVIDIA_SMI_ARGS[0]: (data_dir / "smi-mem.csv").read_text(),
            NVIDIA_SMI_APPS_ARGS[0]: "431, GPU-unknown, 5\n",
            NVIDIA_SMI_UUID_ARGS[0]: (data_dir / "smi-index-uuid.csv").read_text(),
        }
    )
    client = await supervisor(
        INFERENCE_ONLY, search_path=str(smi.parent), exec_=fake, gpu_source="nvidia-smi"
    )
    response = await client.get("/v1/gpu/processes", headers=auth)
    assert response.status == 502
    assert "unknown GPU" in (await response.json())["error"]["message"]


@dataclass
class NvmlProcess:
    pid: int
    usedGpuMemory: int | None  # noqa: N815  (NVML's name)


@dataclass
class FakeNvmlWithProcesses(FakeNvml):
    running: dict[int, list[NvmlProcess]] = field(default_factory=dict)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: object) -> list[NvmlProcess]:  # noqa: N802
        assert isinstance(handle, int)
        return self.running.get(handle, [])


async def test_nvml_lists_the_compute_processes() -> None:
    fake = FakeNvmlWithProcesses(
        gpus=[(0, 616 * MIB, 143771 * MIB), (21714 * MIB, 616 * MIB, 143771 * MIB)],
        running={1: [NvmlProcess(os.getpid(), 21090 * MIB), NvmlProcess(2**22 + 7, None)]},
    )
    source = NvmlSource.open(fake)
    assert await source.processes() == {
        1: (
            GpuProcess(pid=os.getpid(), name=process_name(os.getpid()), used_mib=21090.0),
            GpuProcess(pid=2**22 + 7, name=None, used_mib=None),
        )
    }
    # An NVML without the call cannot list them: an error, never an empty list.
    with pytest.raises(GpuMemorySourceError, match="cannot list"):
        await NvmlSource.open(FakeNvml()).processes()
