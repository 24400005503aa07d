"""The hardware model, below the judge, the proposer and the reports: the device's clock
(``clock``), its measured ceilings (``probe``), a task's FLOP and byte counts (``counts``) and
the roofline floor they give (``floors``)."""
