"""Dashboards, Prometheus rules and provisioning, generated from the metric contract
(`ac-observe dashboards generate`): grafana.py builds the Grafana dashboards, promql.py the
PromQL of every statistic and the drift rules as Prometheus alert rules, generate.py writes
what is committed under dashboards/ (and checks it is current)."""
