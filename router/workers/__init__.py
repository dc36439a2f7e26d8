"""Several router processes on one port: the supervisor and the figures merged across workers."""
