"""TFRecords without TensorFlow: the record framing with its CRC32C checks (``framing``), the
``tf.train.Example`` messages defined from their public schema (``example``), and a batch parser
that returns what ``tf.io.parse_example`` and tpurun's decoding return (``decode``)."""
