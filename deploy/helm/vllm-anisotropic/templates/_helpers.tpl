{{/*
Chart name, truncated to the 63 characters a Kubernetes name allows.
*/}}
{{- define "vllm-anisotropic.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name: <release>-<chart>, or the release name alone when it already
contains the chart name. Example: release "goose" -> "goose-vllm-anisotropic".
*/}}
{{- define "vllm-anisotropic.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "vllm-anisotropic.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "vllm-anisotropic.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vllm-anisotropic.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "vllm-anisotropic.labels" -}}
helm.sh/chart: {{ include "vllm-anisotropic.chart" . }}
{{ include "vllm-anisotropic.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: inference
{{- end }}

{{/*
Name of the model-cache PVC: the existing claim, or the one this chart creates.
*/}}
{{- define "vllm-anisotropic.cacheClaimName" -}}
{{- if .Values.modelCache.existingClaim }}
{{- .Values.modelCache.existingClaim }}
{{- else }}
{{- printf "%s-model-cache" (include "vllm-anisotropic.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/*
The --speculative-config value: one compact JSON object, keys sorted,
{"method": <speculative.method>} merged with speculative.options[<method>].
`merge` keeps the left dict's keys, so options cannot override "method".
Example: method goose, options.goose {budget: 60, top_k: 10}
  -> {"budget":60,"method":"goose","top_k":10}
*/}}
{{- define "vllm-anisotropic.speculativeConfig" -}}
{{- $method := .Values.speculative.method }}
{{- $options := index (.Values.speculative.options | default dict) $method | default dict }}
{{- merge (dict "method" $method) (deepCopy $options) | toJson }}
{{- end }}

{{/*
Resources of the vLLM container: .Values.resources plus, when gpu.enabled,
<gpu.resourceName>: tensorParallelSize in both requests and limits (extended resources
must have request == limit).
*/}}
{{- define "vllm-anisotropic.resources" -}}
{{- $resources := deepCopy (.Values.resources | default dict) }}
{{- if .Values.gpu.enabled }}
{{- $gpus := int64 .Values.tensorParallelSize }}
{{- $requests := $resources.requests | default dict }}
{{- $limits := $resources.limits | default dict }}
{{- $_ := set $requests .Values.gpu.resourceName $gpus }}
{{- $_ := set $limits .Values.gpu.resourceName $gpus }}
{{- $_ := set $resources "requests" $requests }}
{{- $_ := set $resources "limits" $limits }}
{{- end }}
{{- toYaml $resources }}
{{- end }}
