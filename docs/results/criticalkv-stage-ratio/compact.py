"""Copy a sweep's output into this folder with its rows in one Parquet file.

python compact.py SRC DST     # SRC: the job's --output; DST: e.g. screen-4k
"""

import shutil
import sys
from pathlib import Path

import pyarrow.parquet as pq

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
(dst / "data").mkdir(parents=True, exist_ok=True)
table = pq.read_table(src / "data")
pq.write_table(table, dst / "data" / "rows.parquet", compression="zstd")
for name in ("manifest.json", "report.md"):
    if (src / name).exists():
        shutil.copy(src / name, dst / name)
print(dst, table.num_rows, "rows")
