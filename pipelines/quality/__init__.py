"""Quality: Great Expectations suites and validation of dataset versions, drift against the
production model's training data, failure-mode triage."""
