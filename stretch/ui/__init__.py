"""A live web page for stretch jobs and clusters, as Flink's web UI is for Flink's: the job graph
with each operator's parallelism, busy instances and gate depth, rescales, updates and checkpoints
as they happen, a rescale control, throughput and backlog charts, and on a cluster its nodes and
key-group map.

``stretch ui`` serves this user's jobs on this machine (and a cluster's, with ``--cluster``);
``env.execute_async(name, ui=True)`` serves one job from its own process, and
``StretchCluster.local(..., ui=True)`` a cluster from its driver. Serving needs the ``ui`` extra
(``pip install 'stretch[ui]'``).
"""

from stretch.ui.config import UIConfig

__all__ = ["UIConfig"]
