"""The `coordinatorctl inject` fault language: every form parses to its struct; bad ones are
refused with one line naming the fault and the expected form."""

from __future__ import annotations

import pytest

from proto.faults import (
    ClearFault,
    ClockOffsetFault,
    Fault,
    GpuTempFault,
    HangFault,
    KillAgentFault,
    KillWorkerFault,
    LinkFault,
    LoseNodeFault,
    NanLossFault,
    NvmeLatencyFault,
    NvmeReadonlyFault,
    PcieBwFault,
    SlowFault,
    SpotNoticeFault,
    parse_fault,
)

GOOD: list[tuple[str, Fault]] = [
    ("nvme-latency=500", NvmeLatencyFault(latency_us=500.0)),
    ("nvme-latency=250.5@nvme1n1", NvmeLatencyFault(latency_us=250.5, device="nvme1n1")),
    ("nvme-readonly=on", NvmeReadonlyFault(readonly=True)),
    ("nvme-readonly=off", NvmeReadonlyFault(readonly=False)),
    ("gpu-temp=92", GpuTempFault(temp_c=92.0)),
    ("gpu-temp=88.5@3", GpuTempFault(temp_c=88.5, gpu=3)),
    ("clock-offset=12", ClockOffsetFault(offset_ms=12.0)),
    ("clock-offset=-7.5", ClockOffsetFault(offset_ms=-7.5)),
    ("spot-notice=120", SpotNoticeFault(deadline_s=120.0)),
    ("spot-notice=0", SpotNoticeFault(deadline_s=0.0)),
    ("pcie-bw=3.2", PcieBwFault(gbps=3.2)),
    ("pcie-bw=1@0", PcieBwFault(gbps=1.0, gpu=0)),
    ("link=0-1:PHB", LinkFault(gpu_a=0, gpu_b=1, link="PHB")),
    ("link=2-3:NV12", LinkFault(gpu_a=2, gpu_b=3, link="NV12")),
    ("link=1-0:SYS", LinkFault(gpu_a=1, gpu_b=0, link="SYS")),
    ("link=4-5:NODE", LinkFault(gpu_a=4, gpu_b=5, link="NODE")),
    ("link=6-7:PIX", LinkFault(gpu_a=6, gpu_b=7, link="PIX")),
    ("link=0-7:PXB", LinkFault(gpu_a=0, gpu_b=7, link="PXB")),
    ("kill-worker", KillWorkerFault()),
    ("kill-agent", KillAgentFault()),
    ("lose-node", LoseNodeFault()),
    ("hang", HangFault()),
    ("hang=3", HangFault(rank=3)),
    ("slow=3", SlowFault(factor=3.0)),
    ("slow=1", SlowFault(factor=1.0)),
    ("nan-loss", NanLossFault()),
    ("clear", ClearFault()),
]


@pytest.mark.parametrize(("text", "expected"), GOOD, ids=[t for t, _ in GOOD])
def test_every_form_parses_and_prints_back(text: str, expected: Fault) -> None:
    fault = parse_fault(text)
    assert fault == expected
    assert parse_fault(str(fault)) == fault


def test_canonical_form() -> None:
    assert str(parse_fault(" nvme-latency=0500.0@nvme1n1 ")) == "nvme-latency=500@nvme1n1"


BAD = [
    ("nvme-latancy=500", "unknown fault 'nvme-latancy'; expected one of: nvme-latency,"),
    ("", "unknown fault ''"),
    ("nvme-latency", "bad fault 'nvme-latency': missing value; expected nvme-latency=<µs>"),
    ("nvme-latency=", "missing value"),
    ("nvme-latency=fast", "'fast' is not a number"),
    ("nvme-latency=0", "latency must be above 0"),
    ("nvme-latency=-5", "-5 is out of range"),
    ("nvme-latency=nan", "nan is out of range"),
    ("nvme-latency=inf", "inf is out of range"),
    ("nvme-latency=500@sda", "'sda' is not an NVMe namespace like nvme0n1"),
    ("nvme-latency=500@nvme0n1p1", "'nvme0n1p1' is not an NVMe namespace"),
    ("nvme-readonly=yes", "'yes' is not on or off; expected nvme-readonly=on|off"),
    ("gpu-temp=200", "200 is out of range; expected gpu-temp=<°C>[@gpu] with 0 <= °C <= 150"),
    ("gpu-temp=90@gpu0", "GPU 'gpu0' is not an index"),
    ("gpu-temp=90@", "bad fault 'gpu-temp=90@': nothing after '@'"),
    ("nvme-latency=500@", "nothing after '@'"),
    ("gpu-temp=90@-1", "GPU '-1' is not an index"),
    ("clock-offset=5ms", "'5ms' is not a number; expected clock-offset=<ms>"),
    ("spot-notice=-1", "-1 is out of range; expected spot-notice=<s> with s >= 0"),
    ("pcie-bw=-3", "-3 is out of range"),
    ("pcie-bw=3@x", "GPU 'x' is not an index"),
    ("link=0-0:PHB", "'0-0:PHB' is not a link between two GPUs"),
    ("link=0-1:NV0", "'0-1:NV0' is not a link"),
    ("link=0-1:NVLINK", "is not a link"),
    ("link=0:PHB", "is not a link"),
    ("link=0-1:phb", "is not a link"),
    ("kill-worker=3", "bad fault 'kill-worker=3': takes no value; expected kill-worker"),
    ("clear=all", "takes no value"),
    ("lose-node=1", "takes no value; expected lose-node"),
    ("nan-loss=yes", "takes no value; expected nan-loss"),
    ("hang=one", "rank 'one' is not a rank number; expected hang[=<rank>]"),
    ("hang=-1", "rank '-1' is not a rank number"),
    ("hang=", "rank '' is not a rank number"),
    ("slow=0.5", "0.5 is out of range; expected slow=<factor> with 1 <= factor <= 1000"),
    ("slow=fast", "'fast' is not a number"),
    ("slow", "missing value"),
]


@pytest.mark.parametrize(("text", "message"), BAD, ids=[t or "empty" for t, _ in BAD])
def test_bad_faults_are_refused_in_one_line(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_fault(text)
    assert message in str(info.value)
    assert "\n" not in str(info.value)
