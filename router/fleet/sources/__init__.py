"""Sources of membership: the config file (reloaded), the admin API, Kubernetes pod discovery.

Each feeds the one :class:`router.fleet.membership.Membership` under its own origin; none of them
does anything else to the router.
"""
