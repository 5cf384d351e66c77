"""The tuning service: jobs queued in the study database and workers that run them (`jobs`, `worker`)."""
