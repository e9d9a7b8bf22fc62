"""The component contracts, one module per idea; plugins import them from ``streamrl.api``."""
