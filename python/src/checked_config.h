#pragma once
// A config the Python side gives as a file path or as JSON text (a dict),
// checked strictly: every error issue in one InvalidArgument (raised).
#include <optional>
#include <string>

#include "errors.h"
#include "strata/core/config.h"

namespace strata::python {

inline ConfigCheck checked_config(const std::optional<std::string>& path, const std::optional<std::string>& text,
                                  ConfigOptions options) {
  if (path.has_value() == text.has_value())
    raise_status(InvalidArgument("give the config as a file path or as JSON text, exactly one of them"));
  if (!path) options.source = "<dict>";
  ConfigCheck check = path ? check_config_file(*path, options) : check_config_text(*text, options);
  if (!check.ok()) {
    std::string errors;
    for (const ConfigIssue& issue : check.issues)
      if (issue.severity == IssueSeverity::kError)
        errors += (errors.empty() ? "" : "\n") + format_issue(issue, check.config.source);
    raise_status(InvalidArgument(errors));
  }
  return check;
}

}  // namespace strata::python
