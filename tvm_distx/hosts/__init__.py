"""Several hosts: which ranks run where, how to reach them, and what each must hold.

- :mod:`~tvm_distx.hosts.hostfile`: hostfiles and ``--hosts`` lists as MPICH reads them,
  and the placement of ranks on hosts (:func:`place_ranks`);
- :mod:`~tvm_distx.hosts.rsh`: the one remote shell (``ssh`` by default, ``rsh=``,
  ``TVM_DISTX_RSH``) and commands run on many hosts at once;
- :mod:`~tvm_distx.hosts.deploy`: each host's copy of a bundle, with only its ranks'
  weights (:func:`deploy`, :func:`split`), and the check before a launch
  (:func:`check_deployed`);
- :mod:`~tvm_distx.hosts.remote`: what runs on a host to check its copy.

It sits between the runtime (which launches ranks on these hosts) and the bundle
format, and imports no TVM.
"""

from tvm_distx.hosts.deploy import HostReport, bundle_sha256, check_deployed, deploy, split
from tvm_distx.hosts.hostfile import (Host, RankPlacement, hosts_from, parse_hosts, place_ranks,
                                      read_hostfile)
from tvm_distx.hosts.rsh import RemoteResult, remote_argv, remote_shell, run_on_hosts

__all__ = ["Host", "RankPlacement", "read_hostfile", "parse_hosts", "hosts_from", "place_ranks",
           "remote_shell", "remote_argv", "run_on_hosts", "RemoteResult",
           "deploy", "split", "check_deployed", "HostReport", "bundle_sha256"]
