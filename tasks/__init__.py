"""The units of work: plain typed functions on typed records, each run as one Dask task."""
