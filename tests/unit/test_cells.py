"""The cell's typed fields: arms and backends are the enums' values, kept as plain str (plans are YAML)."""

import pytest
import yaml

from kvpool.cells import BACKENDS, Arm, Backend, Cell


def test_a_cell_refuses_an_arm_or_backend_kvpool_does_not_know():
    with pytest.raises(ValueError, match=r"'shard' is not an arm kvpool knows \(shared, isolated, off\)"):
        Cell("lmcache-fs", "shard", 256, "disk")
    with pytest.raises(ValueError, match=r"'lmcache-nfs' is not a backend kvpool knows"):
        Cell("lmcache-nfs", "shared", 256, "disk")


def test_a_cell_built_from_the_enums_holds_plain_strings_yaml_can_write():
    cell = Cell(Backend.MP, Arm.SHARED, 256, "ram")
    assert cell == Cell("lmcache-mp", "shared", 256, "ram")
    assert type(cell.backend) is str and type(cell.arm) is str
    assert yaml.safe_load(yaml.safe_dump({"backend": cell.backend, "arm": cell.arm})) == {
        "backend": "lmcache-mp", "arm": "shared"}
    assert BACKENDS == ("lmcache-fs", "lmcache-local-disk", "lmcache-mp", "lmcache-redis", "vllm-fs")


def test_a_cells_keys_are_the_tables_columns_that_name_it():
    cell = Cell("lmcache-mp", "isolated", 256, "disk", 2)
    assert cell.keys() == {"cell": cell.name, "backend": "lmcache-mp+gpu_workers=2", "arm": "isolated",
                           "chunk": 256, "tier": "disk"}
    assert list(cell.keys(arm=False)) == ["cell", "backend", "chunk", "tier"]
