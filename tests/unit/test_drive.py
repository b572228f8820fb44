import os
from pathlib import Path

import pandas as pd
import pytest

from kvpool.measure.drive import block_devices, iostat, read_diskstats

FIXTURE = Path(__file__).parents[1] / "fixtures" / "diskstats-two-samples.txt"


def fixture_samples(device="nvme0n1"):
    blocks = [b for b in FIXTURE.read_text().split("---")]
    rows = []
    for t, block in zip((10.0, 12.0), blocks, strict=True):
        rows.append({"t_s": t, "device": device, **read_diskstats(block, {device})[device]})
    return pd.DataFrame(rows)


def test_iostat_matches_hand_computed_answers():
    row = iostat(fixture_samples()).iloc[0]
    # 400 reads, 1,024,000 sectors (524,288,000 bytes), 1,200 ms reading, over 2 s:
    assert row["r_per_s"] == pytest.approx(200.0)
    assert row["r_mb_per_s"] == pytest.approx(262.144)      # 524.288 MB over 2 s
    assert row["rareq_kb"] == pytest.approx(1280.0)          # 512,000 kB / 400 reads
    assert row["r_await_ms"] == pytest.approx(3.0)            # 1,200 ms / 400 reads
    assert row["r_bytes"] == 524_288_000
    # 10 writes, 800 sectors, 50 ms:
    assert row["w_per_s"] == pytest.approx(5.0)
    assert row["wareq_kb"] == pytest.approx(40.0)
    assert row["w_await_ms"] == pytest.approx(5.0)
    # queue: 3,000 weighted ms over 2,000 ms; busy 1,500 ms of 2,000
    assert row["aqu_sz"] == pytest.approx(1.5)
    assert row["util_pct"] == pytest.approx(75.0)


def test_idle_interval_has_no_request_size_or_await():
    frame = pd.concat([fixture_samples().iloc[[1]], fixture_samples().iloc[[1]].assign(t_s=13.0)])
    row = iostat(frame).iloc[0]
    assert row["r_per_s"] == 0 and pd.isna(row["rareq_kb"]) and pd.isna(row["r_await_ms"])


def test_read_diskstats_filters_devices():
    text = FIXTURE.read_text().split("---")[0]
    assert set(read_diskstats(text)) == {"nvme0n1", "nvme0n1p1"}
    assert read_diskstats(text, {"nvme0n1p1"})["nvme0n1p1"]["rd_sectors"] == 180000


def test_a_normal_directory_resolves_to_its_disk(tmp_path):
    record = block_devices(tmp_path)
    if record["device"] is None:
        pytest.skip(f"{tmp_path} is not on a block device here: {record}")
    assert record["disks"], record
    for disk in record["disks"]:
        assert Path(f"/sys/block/{disk}").exists()
        assert f" {disk} " in Path("/proc/diskstats").read_text()


def test_dev_shm_has_no_block_device():
    record = block_devices(Path("/dev/shm"))
    assert record["device"] is None and record["disks"] == [] and "memory-backed" in record["note"]


def test_partition_and_device_mapper_resolution(tmp_path):
    # A fake /sys: dm-0 sits on nvme0n1p2 (a partition of nvme0n1) and on sdb.
    sys_root = tmp_path / "sys"
    devices = sys_root / "devices"
    (devices / "nvme0n1" / "nvme0n1p2").mkdir(parents=True)
    (devices / "nvme0n1" / "nvme0n1p2" / "partition").write_text("2\n")
    (devices / "sdb").mkdir()
    (devices / "dm-0" / "slaves").mkdir(parents=True)
    os.symlink(devices / "nvme0n1" / "nvme0n1p2", devices / "dm-0" / "slaves" / "nvme0n1p2")
    os.symlink(devices / "sdb", devices / "dm-0" / "slaves" / "sdb")
    from kvpool.measure.drive import _whole_disks

    assert _whole_disks(devices / "dm-0") == {"nvme0n1", "sdb"}
    assert _whole_disks(devices / "nvme0n1" / "nvme0n1p2") == {"nvme0n1"}


def test_smart_log_parser():
    from kvpool.measure.drive import parse_smart_log

    health = parse_smart_log((FIXTURE.parent / "nvme-smart-log-v2.json").read_text())
    assert health["temperature_c"] == pytest.approx(42.85)    # 316 K
    assert health["percent_used"] == 0 and health["avail_spare"] == 100
    assert health["data_units_read"] == 1186935 and health["media_errors"] == 0
    # nvme-cli 2.x spells two of them differently
    newer = parse_smart_log('{"temperature": 300, "percentage_used": 3, "available_spare": 97}')
    assert (newer["percent_used"], newer["avail_spare"]) == (3, 97)


def test_health_of_a_disk_without_sensors_says_why(tmp_path):
    from kvpool.measure.drive import drive_health

    record = drive_health("vdz", sys_root=tmp_path)
    assert "hwmon_temperature_c" not in record and record["hwmon_unavailable"]
    assert record["smart_log_unavailable"] == "not an NVMe device"


def test_hwmon_temperature_is_read_in_millidegrees(tmp_path):
    from kvpool.measure.drive import drive_health

    sensor = tmp_path / "block" / "nvme0n1" / "device" / "hwmon3"
    sensor.mkdir(parents=True)
    (sensor / "temp1_input").write_text("43850\n")
    def failing(argv, **kw):
        return __import__("subprocess").CompletedProcess(argv, 1, "", "permission denied")

    record = drive_health("nvme0n1", sys_root=tmp_path, run=failing)
    assert record["hwmon_temperature_c"] == pytest.approx(43.85)


def test_sequential_read_ceiling_reads_the_whole_file(tmp_path):
    from kvpool.measure.drive import sequential_read_ceiling

    result = sequential_read_ceiling(tmp_path, 32 << 20, block_bytes=1 << 20)
    assert result["bytes"] == 32 << 20 and result["gb_per_s"] > 0
    assert not list(tmp_path.iterdir())  # the scratch file is gone


def test_drive_model_is_read_where_the_kernel_exposes_it(tmp_path):
    from kvpool.measure.drive import _model

    device = tmp_path / "block" / "nvme0n1" / "device"
    device.mkdir(parents=True)
    (device / "model").write_text("SOLIDIGM SB5PH27X153T  \n")
    assert _model("nvme0n1", tmp_path) == "SOLIDIGM SB5PH27X153T"
    assert _model("vda", tmp_path) is None


def test_a_ceiling_is_read_from_a_scratch_file_of_its_own_and_flagged_beside_another_runs(tmp_path, monkeypatch,
                                                                                          config):
    """Two runs on one tier: each reads its own scratch file under its own pools folder, and one that finds
    the other's scratch file meanwhile says its figure is a shared device's, not the tier's ceiling."""
    import json

    from kvpool.settings import step_settings
    from kvpool.studies import study_a

    run, tier = tmp_path / "run", tmp_path / "tier"
    run.mkdir()
    monkeypatch.chdir(run)
    config = {**step_settings(study_a.run_ceiling, config), "tiers": {"disk": str(tier)},
              "drive_ceiling_bytes": 8 << 20}
    study_a.run_ceiling(config, "disk", str(run / "alone.json"))
    alone = json.loads((run / "alone.json").read_text())
    assert alone["concurrent_ceilings"] == [] and alone["bytes"] == 8 << 20
    assert alone["link"]["applicable"] is False and alone["link"]["measured"] == "host memory copy"
    assert not list(tier.rglob("*.scratch"))  # its own scratch file is gone
    other = tier / "kvpool-pools" / "other-run-1a2b3c4d" / "ceiling" / "ceiling-99.scratch"
    other.parent.mkdir(parents=True)
    other.write_bytes(b"\0" * 4096)
    study_a.run_ceiling(config, "disk", str(run / "beside.json"))
    assert json.loads((run / "beside.json").read_text())["concurrent_ceilings"] == [str(other)]
