"""What the compiler decided, for people: the sharding table, the communication report, views.

- :mod:`~tvm_distx.reports.explain`: every value's sharding and the reason for it;
- :mod:`~tvm_distx.reports.comm_report`: the collectives a program runs and their bytes;
- :mod:`~tvm_distx.reports.views`: both drawn as tables and pictures.
"""
