"""Copy a sweep's rows (one Parquet file) and report into this folder; the run's manifest stays behind
(its command and revision are in README.md; ``python -m pipeline.report DST`` remakes the report from the rows).

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
if (src / "report.md").exists():
    shutil.copy(src / "report.md", dst / "report.md")
print(dst, table.num_rows, "rows")
